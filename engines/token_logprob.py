"""Per-token log-prob and entropy from logits (the unfused path), in float32."""
from __future__ import annotations

import torch

from .fused_logprob import check_labels_on_host


def logprob_entropy_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature, *,
                                return_entropy: bool = True, ignore_index: int = -100):
    """``log_softmax(logits / T)[label]`` and the entropy per row of ``logits (N, V)``;
    rows whose label is ``ignore_index`` give 0 for both. ``temperature``: float or ``(N,)``."""
    check_labels_on_host(labels, logits.shape[-1], ignore_index)
    z = logits.float()
    if torch.is_tensor(temperature):
        z = z / temperature.to(torch.float32).unsqueeze(-1)
    elif temperature != 1.0:
        z = z / float(temperature)
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=picked.dtype, device=picked.device)
    log_probs = torch.where(valid, picked, zero)
    entropy = None
    if return_entropy:
        ent = -(torch.exp(logp) * logp).sum(-1)
        entropy = torch.where(valid, ent, zero)
    return log_probs, entropy
