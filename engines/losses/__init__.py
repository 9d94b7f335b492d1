"""The engine's losses in one import: SFT here, PPO/GRPO and GSPO (engines/losses/ppo.py, their
behaviour-policy correction in engines/losses/correction.py).

Every loss follows the contract in :mod:`polyfsdp.engines.losses.inputs`: it receives one
micro-batch as flat per-token tensors plus ``offsets`` and the step-wide (all micro-batches,
all ranks) token and sequence counts, and returns ``(loss, metrics)`` with metrics as
detached 0-d tensors (read to the host once per optimizer step, never per micro-batch).

Normalisation is by the GLOBAL counts, so each micro-batch returns its *share* of the
step's loss: summing the shares over micro-batches and ranks gives exactly the loss of the
whole batch, however it was split. The engine must therefore SUM gradients over ranks
(not average them). Metrics are shares in the same sense (token means over the global
response-token count), so the engine sums them over micro-batches and ranks too.

The building blocks live beside it: the contract and its shape checks in engines/losses/inputs.py,
the aggregation modes in engines/losses/aggregation.py, the critic's loss in engines/losses/value.py.
"""
from __future__ import annotations

import torch

from .aggregation import AGG_MODES, aggregate, check_agg_mode, segment_ids, segment_sum, token_share
from .correction import LOG_RATIO_CLAMP, MASK_LEVELS
from .inputs import LossInputs, check_inputs, is_token_separable, reads_masked_positions_only
from .ppo import (DEFAULT_CLIP_RATIO_HIGH, GSPO_CLIP_RATIO_HIGH, GSPO_CLIP_RATIO_LOW, GSPO_LOG_RATIO_CLAMP,
                  K3_BOUND, K3_LOG_RATIO_BOUND, KL_TYPES, PPO_AGG_MODES, GSPOLoss, PPOLoss, clip_metrics, kl_penalty)

__all__ = ["AGG_MODES", "DEFAULT_CLIP_RATIO_HIGH", "GSPO_CLIP_RATIO_HIGH", "GSPO_CLIP_RATIO_LOW",
           "GSPO_LOG_RATIO_CLAMP", "K3_BOUND", "K3_LOG_RATIO_BOUND", "KL_TYPES", "LOG_RATIO_CLAMP", "MASK_LEVELS",
           "PPO_AGG_MODES",
           "GSPOLoss", "LossInputs", "PPOLoss", "SFTLoss", "aggregate", "check_agg_mode", "check_inputs",
           "clip_metrics", "is_token_separable", "reads_masked_positions_only",
           "kl_penalty", "segment_ids", "segment_sum", "token_share"]


class SFTLoss:
    """Negative log-likelihood of the tokens selected by ``mask_field`` (the response)."""

    requires_entropy = False
    token_separable = True  # every aggregation mode weights tokens by constants of the step
    masked_positions_only = True  # reads log-probs only under mask_field (engines/head/rows.py)

    def __init__(self, agg_mode: str = "token-mean", mask_field: str = "response_mask"):
        self.agg_mode = check_agg_mode(agg_mode)
        self.mask_field = mask_field
        self.required_fields = (mask_field,)

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return ``(loss, {"nll": ...})`` for one micro-batch."""
        check_inputs(inputs, self.required_fields, need_entropy=False, loss_name="SFTLoss")
        log_probs = inputs.log_probs.float()
        mask = inputs.fields[self.mask_field].to(log_probs.dtype)
        loss = aggregate(-log_probs, mask, inputs, self.agg_mode)
        metrics = {"nll": token_share(-log_probs, mask, inputs)}
        return loss, metrics
