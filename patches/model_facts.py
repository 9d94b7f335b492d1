"""The facts a backend judges its fused ops by, read from one model's config (and compute dtype)."""
from __future__ import annotations

import torch
from torch import nn

from polyfsdp.backends.base import ModelFacts


def model_facts(model: nn.Module, compute_dtype: torch.dtype | None = None) -> ModelFacts | None:
    """``ModelFacts`` of a decoder's config, or None when the config lacks the attention shape.
    ``compute_dtype``: the dtype the model will compute in (FSDP ``param_dtype``); default the
    dtype of its first parameter."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):  # a vision-language model: its text decoder's shape
        config = config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads < 1:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if compute_dtype is None:
        first = next(model.parameters(), None)
        compute_dtype = first.dtype if first is not None else torch.float32
    return ModelFacts(num_attention_heads=heads, num_key_value_heads=int(kv_heads), head_dim=int(head_dim),
                      compute_dtype=compute_dtype)
