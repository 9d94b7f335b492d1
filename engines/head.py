"""The fused log-prob head: decoder body -> pack real tokens -> chunked log-prob/entropy.

Installed as a method on the root module and registered with FSDP2
(``register_fsdp_forward_method``) so the root's parameters, the LM-head weight among
them, are unsharded while it runs.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

from .fused_logprob import fused_logprob_entropy
from .jagged import IGNORE_INDEX

FUSED_HEAD_METHOD = "polyfsdp_fused_head"
# Config attributes through which some families rescale logits inside their forward
# (Cohere logit_scale, Granite logits_scaling, Falcon-H1 lm_head_multiplier). The fused
# op does not reproduce them, so those models use the unfused path.
_LOGIT_SCALE_ATTRS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier_scale")


@dataclass
class HeadOptions:
    """Non-tensor options of one fused-head call (kept out of FSDP's input handling)."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    temperature: float | torch.Tensor
    return_entropy: bool
    softcap: float | None


def fused_head_support(model) -> tuple[float | None, str | None]:
    """``(softcap, None)`` when the fused head reproduces ``model``'s logits (with that
    final soft-cap, or None), else ``(None, reason)``."""
    config = model.config
    if not isinstance(getattr(model, "model", None), torch.nn.Module):
        return None, f"{type(model).__name__} has no decoder body at .model"
    for name in _LOGIT_SCALE_ATTRS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            return None, f"{type(model).__name__} scales its logits ({name}={value})"
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return None, f"{type(model).__name__}.lm_head is not a plain nn.Linear"
    if head.bias is not None:
        return None, f"{type(model).__name__}.lm_head has a bias"
    softcap = getattr(config, "final_logit_softcapping", None)
    return (float(softcap) if softcap else None), None


def _fused_head(self, model_inputs: dict, labels: torch.Tensor, options: HeadOptions):
    """Run the decoder body, pack its hidden states to real tokens, apply the fused op."""
    hidden = self.model(**model_inputs, use_cache=False).last_hidden_state
    packed = options.pack(hidden)
    return fused_logprob_entropy(packed, self.lm_head.weight, labels, temperature=options.temperature,
                                 return_entropy=options.return_entropy, ignore_index=IGNORE_INDEX,
                                 softcap=options.softcap)


def install_fused_head(model) -> None:
    """Attach the fused-head method to this model instance (not its class)."""
    setattr(model, FUSED_HEAD_METHOD, types.MethodType(_fused_head, model))
