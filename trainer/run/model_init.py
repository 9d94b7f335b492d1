"""The starting checkpoint of a run built from a tiny preset.

The engine's ModelConfig builds a preset at its fixed size; the trainer's default model is
a preset resized with Hugging Face config ``overrides`` (and the tokenizer's vocabulary
and special ids). It is written once, with its tokenizer, as an ordinary Hugging Face
checkpoint directory that every phase then loads with ``ModelConfig(path=...)``.
"""
from __future__ import annotations

import logging
import os

import torch

from polyfsdp.backends.distributed import barrier, current_rank
from polyfsdp.engines.checkpoint.files import remove_path
from polyfsdp.engines.presets import preset_config

logger = logging.getLogger(__name__)


def write_initial_model(directory: str, preset: str, overrides: dict, tokenizer, seed: int) -> str:
    """Rank 0 writes preset ``preset`` with ``overrides`` (weights from ``seed``) and the
    tokenizer into ``directory``; every rank waits for it. Returns ``directory``."""
    from polyfsdp.engines.model.builder import auto_class_for

    if current_rank() == 0 and not os.path.isfile(os.path.join(directory, "config.json")):
        special = {"vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_token_id,
                   "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
        plain = preset_config(preset)
        if getattr(plain, "vision_config", None) is not None:
            # The vision tokens sit at the top of the preset's vocabulary (trainer/data/vision.py):
            # the vocabulary keeps its size while the characters fit below them.
            special["vocab_size"] = max(tokenizer.vocab_size, plain.text_config.vocab_size)
        # Overrides are user input: Hugging Face rejects some in the config (its own exception
        # types), others only fail in forward (heads that do not divide), so run one token pair.
        try:
            config = preset_config(preset, **{**dict(overrides), **special})
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = auto_class_for(config).from_config(config, dtype=torch.float32)
                with torch.no_grad():
                    model(torch.tensor([[tokenizer.eos_token_id] * 2]), use_cache=False)
        except Exception as exc:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(f"the {preset} model these overrides describe cannot run: {detail}") from None
        tmp = directory + ".tmp"
        # A leftover that is a link (a crafted run's, to any directory) goes itself: saving
        # through it would write the model into its target.
        remove_path(tmp)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, directory)
        n = sum(p.numel() for p in model.parameters())
        sizes = ", ".join(f"{k}={v}" for k, v in dict(overrides).items())
        print(f"initial model: {preset} ({sizes}), {n / 1e6:.2f}M parameters -> {directory}", flush=True)
    barrier()
    return directory
