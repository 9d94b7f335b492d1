"""How every loss reduces per-token terms: shares of the step's global counts.

A loss receives one micro-batch (engines/losses/inputs.py) and returns its *share* of the step's
loss: normalised by the GLOBAL token and sequence counts (all micro-batches, all ranks), so the
shares sum to the whole batch's loss however it was split, and the engine SUMS gradients over
ranks. The policy losses (engines/losses/ppo.py), SFT (engines/losses/) and the critic's value
loss (engines/losses/value.py) all aggregate through :func:`aggregate` and report metrics as
:func:`token_share`.
"""
from __future__ import annotations

import torch

from .inputs import LossInputs

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def segment_ids(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every flat token, from ``offsets`` (no Python loop, no host sync)."""
    lengths = offsets[1:] - offsets[:-1]
    ids = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(ids, lengths, output_size=total)


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums ``(num_seqs,)`` of a flat ``(total,)`` tensor."""
    num_seqs = offsets.numel() - 1
    seg = segment_ids(offsets.to(values.device), values.numel())
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seg, values)


def aggregate(values: torch.Tensor, mask: torch.Tensor, inputs: LossInputs, agg_mode: str,
              norm_tokens: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` over ``mask`` into this micro-batch's share of the step loss.

    token-mean: sum / global_num_tokens. seq-mean-token-sum: sum of per-sequence sums /
    global_num_seqs. seq-mean-token-mean: sum of per-sequence means / global_num_seqs
    (a sequence without masked tokens contributes 0 but still counts in global_num_seqs).
    seq-mean-token-sum-norm: sum / (global_num_seqs * norm_tokens), a constant per token.
    """
    masked = values * mask
    if agg_mode == "token-mean":
        return masked.sum() / inputs.global_num_tokens
    if agg_mode == "seq-mean-token-sum-norm":
        if norm_tokens is None:
            raise ValueError("agg_mode seq-mean-token-sum-norm needs norm_tokens (a constant token count)")
        return masked.sum() / (inputs.global_num_seqs * norm_tokens)
    per_seq = segment_sum(masked, inputs.offsets)
    if agg_mode == "seq-mean-token-sum":
        return per_seq.sum() / inputs.global_num_seqs
    if agg_mode == "seq-mean-token-mean":
        counts = segment_sum(mask, inputs.offsets)
        return (per_seq / counts.clamp_min(1.0)).sum() / inputs.global_num_seqs
    raise ValueError(f"unknown agg_mode {agg_mode!r}; choose one of {', '.join(AGG_MODES)}")


def token_share(values: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Token-mean share of a metric over the global response-token count (a detached 0-d
    tensor: the engine reads metrics to the host once per optimizer step, not per micro-batch)."""
    return (values.detach() * mask).sum() / inputs.global_num_tokens


def check_agg_mode(agg_mode: str) -> str:
    """``agg_mode`` if it is one of :data:`AGG_MODES`, else a ValueError naming them."""
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; choose one of {', '.join(AGG_MODES)}")
    return agg_mode
