"""The behaviour-policy correction of PPOLoss' policy-gradient term: the tokens were sampled by
another policy (a separate sampler, an older policy in asynchronous RL) than the one the
ratio's "old" log-probs come from, so each token's term is weighted by what the behaviour
ratio ``r = exp(old - rollout)`` (trainer vs sampler log-probs of the same token) allows:

* truncated importance sampling (``tis_cap``): ``min(r, tis_cap)``;
* masked importance sampling (``mask_low`` / ``mask_high``, either alone): 0 for a token whose
  ``r`` lies outside ``[mask_low, mask_high]`` (``mask_level="token"``), or for every token of a
  sequence whose geometric-mean ratio ``exp(mean over its response tokens of (old - rollout))``
  does (``mask_level="sequence"``); verl calls this rollout rejection sampling.

Together the weight is ``min(r, tis_cap) * keep``. A masked token is a weight of 0 in the same
aggregation: the normalisers (the step's global token and sequence counts) do not change.
"""
from __future__ import annotations

import math

import torch

from .aggregation import segment_ids, segment_sum, token_share
from .inputs import LossInputs

MASK_LEVELS = ("token", "sequence")
# exp() of a log-ratio beyond this overflows fp32 long before it carries information (verl's guard).
LOG_RATIO_CLAMP = 20.0


def check_correction(tis_cap: float | None, mask_low: float | None, mask_high: float | None,
                     mask_level: str) -> None:
    """ValueError naming the first impossible option (None switches a bound or the cap off)."""
    if tis_cap is not None and not tis_cap > 0.0:
        raise ValueError(f"tis_cap must be > 0 (or None to disable), got {tis_cap}")
    for key, value in (("mask_low", mask_low), ("mask_high", mask_high)):
        if value is not None and not value > 0.0:
            raise ValueError(f"{key} must be > 0 (or None to disable), got {value}")
    if mask_low is not None and mask_high is not None and not mask_low < mask_high:
        raise ValueError(f"mask_low must be below mask_high, got {mask_low} and {mask_high}")
    if mask_level not in MASK_LEVELS:
        raise ValueError(f"unknown mask_level {mask_level!r}; choose one of {', '.join(MASK_LEVELS)}")


def behaviour_weight(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, inputs: LossInputs,
                     tis_cap: float | None, mask_low: float | None, mask_high: float | None,
                     mask_level: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The detached per-token weight ``min(r, tis_cap) * keep`` (a missing part is 1) and its
    metrics: ``tis_weight_mean`` (the truncated weight before masking) with ``tis_cap``,
    ``mis_masked_frac`` (the share of response tokens masked) with a bound. The bounds are
    compared in log space (inclusive), so no ratio overflows."""
    log_ratio = torch.where(mask > 0, (old - rollout).detach(), torch.zeros_like(old))
    weight, metrics = torch.ones_like(log_ratio), {}
    if tis_cap is not None:
        weight = torch.clamp(torch.exp(torch.clamp(log_ratio, max=LOG_RATIO_CLAMP)), max=tis_cap)
        metrics["tis_weight_mean"] = token_share(weight, mask, inputs)
    if mask_low is not None or mask_high is not None:
        if mask_level == "sequence":
            offsets = inputs.offsets.to(log_ratio.device)
            seq_log_ratio = segment_sum(log_ratio * mask, offsets) / segment_sum(mask, offsets).clamp_min(1.0)
            log_ratio = seq_log_ratio[segment_ids(offsets, log_ratio.numel())]
        keep = torch.ones_like(log_ratio, dtype=torch.bool)
        if mask_low is not None:
            keep &= log_ratio >= math.log(mask_low)
        if mask_high is not None:
            keep &= log_ratio <= math.log(mask_high)
        keep = keep.to(weight.dtype)
        metrics["mis_masked_frac"] = token_share(1.0 - keep, mask, inputs)
        weight = weight * keep
    return weight.detach(), metrics
