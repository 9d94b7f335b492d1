"""Build the Hugging Face model named by a ModelConfig (never downloads), then patch it."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

from polyfsdp.backends.base import Backend

from ..attention import register_attention
from ..config import TORCH_DTYPES, ModelConfig
from ..presets import preset_config
from .vision import install_vision

logger = logging.getLogger(__name__)

def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config dtype name (``float32``, ``bfloat16``, ``float16``)."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype: got {name!r}; allowed values: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def _check_checkpoint_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"ModelConfig.path: {path!r} is not a directory (only local checkpoints are "
                                f"loaded; nothing is downloaded)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"ModelConfig.path: {path!r} has no config.json; expected a Hugging Face "
                                f"checkpoint directory (config.json + weights)")


def build_model(config: ModelConfig, backend: Backend, patch_toggles=None, compute_dtype: str | None = None):
    """Build the causal LM on the CPU in ``config.dtype`` with the chosen attention, apply
    the backend's patches, and return ``(model, patch_report)``. ``compute_dtype`` (the FSDP
    ``param_dtype``; default ``config.dtype``) picks the backend's attention: the weights are
    cast to it before attention runs."""
    register_attention()
    dtype = torch_dtype(config.dtype)
    compute = torch_dtype(compute_dtype or config.dtype)
    if config.attn_implementation is not None:
        return _build(config, dtype, config.attn_implementation, backend, patch_toggles, compute)
    attn = backend.attn_implementation(compute)
    try:
        return _build(config, dtype, attn, backend, patch_toggles, compute)
    except ValueError as exc:
        # The backend's choice is SDPA-based; families without SDPA support (e.g. Gemma-2,
        # for its attention soft-cap) run eager attention instead.
        if "does not support an attention implementation" not in str(exc):
            raise
        logger.warning("%s; using attn_implementation='eager' for this model", str(exc).split(".")[0])
        return _build(config, dtype, "eager", backend, patch_toggles, compute)


def read_hf_config(path: str):
    """The Hugging Face config of checkpoint directory ``path``: read from disk, never downloaded,
    and never by the directory's own Python code (an ``auto_map`` is refused, not run, and nothing
    asks on a terminal)."""
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        if "trust_remote_code" in reason:
            reason = ("its config.json maps the model to the directory's own Python code (auto_map), which "
                      "polyfsdp never runs (trust_remote_code=False); use a model type this transformers "
                      "version ships")
        raise ValueError(f"ModelConfig.path: could not read a model config from {path!r}: {reason}") from None


def _damaged_weights_file(directory: str) -> str | None:
    """The first ``*.safetensors`` file in ``directory`` whose header does not fit the file."""
    for file in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError:
            return str(file)
    return None


def model_class(config: ModelConfig):
    """The Auto class that builds ``config``'s model: a reward model's score head reads a
    sequence-classification checkpoint (its ``score`` layer), everything else a causal LM (a
    reward model with ``value_head_path`` too: the head comes from that file)."""
    if config.score_head and config.value_head_path is None:
        return AutoModelForSequenceClassification
    return AutoModelForCausalLM


def auto_class_for(hf_config, auto=AutoModelForCausalLM):
    """A vision-language config (one with a ``vision_config``) is built by transformers'
    image-text-to-text class (e.g. Qwen2VLForConditionalGeneration), never a plain causal LM."""
    if auto is AutoModelForCausalLM and getattr(hf_config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return auto


def _build(config: ModelConfig, dtype: torch.dtype, attn: str, backend: Backend, patch_toggles,
           compute_dtype: torch.dtype):
    auto = model_class(config)
    what = "a sequence-classification model" if auto is AutoModelForSequenceClassification else "a causal LM"
    if config.path is not None:
        _check_checkpoint_dir(config.path)
        if config.vocab_size is not None:
            raise ValueError(f"ModelConfig.vocab_size: applies to presets only; a checkpoint's vocabulary is "
                             f"fixed by its weights (got vocab_size={config.vocab_size} with path={config.path!r})")
        hf_config = read_hf_config(config.path)
        auto = auto_class_for(hf_config, auto)
        # trust_remote_code stays False and .bin weights load weights-only: nothing in the
        # directory runs.
        try:
            # A shape mismatch is refused below in one line (transformers raises it after a multi-line report).
            model, info = auto.from_pretrained(config.path, config=hf_config, local_files_only=True, dtype=dtype,
                                               attn_implementation=attn, trust_remote_code=False, weights_only=True,
                                               output_loading_info=True, ignore_mismatched_sizes=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"ModelConfig.path: could not load {what} from {config.path!r}: {exc}") from exc
        except SafetensorError as exc:
            raise ValueError(f"ModelConfig.path: {_damaged_weights_file(config.path) or config.path}: unreadable "
                             f"safetensors ({' '.join(str(exc).split())}); truncated or damaged?") from None
        mismatched = sorted(info.get("mismatched_keys", ()))
        if mismatched:
            name, stored, built = mismatched[0]
            raise ValueError(f"ModelConfig.path: {config.path!r}: the weights are not the model its config.json "
                             f"describes: {name} is {list(stored)} in the weights, but its config.json builds it "
                             f"as {list(built)}; use the config.json saved with these weights")
        untrained = [key for key in info.get("missing_keys", ()) if key.split(".")[0] == "score"]
        drawn = sorted(set(info.get("missing_keys", ())) & dict(model.named_parameters()).keys())
        if auto is not AutoModelForSequenceClassification and drawn:
            # transformers draws missing weights at random: a policy (or teacher) with a random head.
            named = ", ".join(getattr(hf_config, "architectures", None) or []) or "its config.json"
            raise ValueError(f"ModelConfig.path: {config.path!r} is not a whole causal LM checkpoint ({drawn[0]} is "
                             f"missing; the checkpoint is {named}): a policy, reference or teacher needs its "
                             f"*ForCausalLM weights")
        if auto is AutoModelForSequenceClassification and untrained:
            # transformers would draw the missing layer at random: a reward model that scores noise.
            raise ValueError(f"ModelConfig.path: {config.path!r} holds no trained score layer ({untrained[0]} is "
                             f"missing): a reward model is a *ForSequenceClassification checkpoint (a causal LM "
                             f"needs its value head file, value_head_path)")
    else:
        overrides = {} if config.vocab_size is None else {"vocab_size": config.vocab_size}
        if auto is AutoModelForSequenceClassification:
            overrides["num_labels"] = 1  # a preset reward model scores with one number
        hf_config = preset_config(config.preset, **overrides)
        auto = auto_class_for(hf_config, auto)
        # The seed fixes the initial weights, so every rank (and a reference) builds the same model.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = auto.from_config(hf_config, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = False
    frozen = install_vision(model, config.freeze_vision)  # a text model: nothing (engines/model/vision.py)
    if frozen:
        logger.debug("freeze_vision: %d vision-tower parameters frozen", len(frozen))
    from polyfsdp.patches import apply_patches

    # The backend judges its fused ops by the dtype FSDP computes in, not the stored one.
    report = apply_patches(model, backend, patch_toggles, compute_dtype=compute_dtype)
    logger.debug("built %s (%s, attn=%s)", type(model).__name__, config.dtype, attn)
    return model, report

