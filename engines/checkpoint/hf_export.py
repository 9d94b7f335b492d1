"""Hugging Face export of a sharded model: the one path for full models and LoRA adapters.

:func:`export_hf` gathers the full state dict on every rank (collective), and rank 0 writes
``save_pretrained`` output: plain weights (a full model, or a LoRA model with its adapters
merged into the base weights) or peft's adapter directory (``adapters="adapter"``:
``adapter_config.json`` + ``adapter_model.safetensors``, for ``PeftModel.from_pretrained`` over
the base model). The engine calls it for its policy and for a critic alike.
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from polyfsdp.backends.distributed import barrier, current_rank

from ..config import ADAPTER_EXPORTS, LoraConfig
from .tokenizer_files import strip_loader_keys

logger = logging.getLogger(__name__)


def _plain_model(config, full: dict, dtype: torch.dtype | None):
    """A fresh, unsharded model built on the meta device holding ``full`` (no second copy)."""
    from ..model.builder import auto_class_for  # a vision-language model: its image-text-to-text class

    if dtype is not None:
        full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    with torch.device("meta"):
        fresh = auto_class_for(config).from_config(config)
    result = fresh.load_state_dict(full, strict=False, assign=True)
    fresh.tie_weights()
    still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
    if still_meta or result.unexpected_keys:
        raise ValueError(f"state dict does not fit {type(fresh).__name__}: missing {still_meta}, "
                         f"unexpected {result.unexpected_keys}")
    fresh.config.dtype = dtype or next(fresh.parameters()).dtype
    return fresh


def _adapted_model(config, full: dict, lora: LoraConfig, adapters: str, dtype: torch.dtype | None):
    """The LoRA model holding ``full``: merged into a plain model, or peft's wrapper (``adapter``)."""
    from ..model.lora import plain_model_with_adapters

    wrapped = plain_model_with_adapters(config, lora, full)
    if adapters == "adapter":
        return wrapped.to(dtype) if dtype is not None else wrapped
    merged = wrapped.merge_and_unload()
    if dtype is not None:
        merged.to(dtype)
    merged.config.dtype = next(merged.parameters()).dtype
    return merged


def export_hf(
    directory: str | os.PathLike,
    *,
    model: torch.nn.Module,
    model_config=None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    lora: LoraConfig | None = None,
    adapters: str = "merged",
) -> Path:
    """Write a consolidated Hugging Face checkpoint (safetensors + config.json) of a sharded model.

    Collective: every rank gathers; rank 0 builds a fresh, unsharded model holding the full
    state and calls ``save_pretrained``, which handles tied embeddings. ``dtype`` casts the
    weights. ``lora``: the model carries these LoRA adapters, exported as ``adapters`` says
    (``merged`` or ``adapter``, :data:`ADAPTER_EXPORTS`).
    """
    if adapters not in ADAPTER_EXPORTS:
        raise ValueError(f"export lora: got {adapters!r}; allowed values: {', '.join(map(repr, ADAPTER_EXPORTS))}")
    if lora is None and adapters != "merged":
        raise ValueError(f"export lora={adapters!r} needs a LoRA model (ModelConfig.lora.rank > 0)")
    directory = Path(directory)
    config = model_config if model_config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("export_hf needs model_config (the model has no .config attribute)")
    # The engine turns the KV cache off for training; a user of the export wants it on.
    config = copy.deepcopy(config)
    config.use_cache = True
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if current_rank() == 0:
        fresh = _plain_model(config, full, dtype) if lora is None else _adapted_model(config, full, lora, adapters,
                                                                                       dtype)
        directory.mkdir(parents=True, exist_ok=True)
        fresh.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
            strip_loader_keys(directory)
        logger.info("exported Hugging Face checkpoint to %s", directory)
    barrier()
    return directory
