"""The critic's loss: PPO's clipped value loss (verl's ``compute_value_loss``).

Per response token, with ``v`` the critic's prediction, ``v_old`` the rollout's value and
``R`` the return::

    v_clipped = clamp(v, v_old - cliprange_value, v_old + cliprange_value)
    loss_t    = 0.5 * max((v - R)^2, (v_clipped - R)^2)

aggregated over ``response_mask`` like the PPO loss (``loss_aggregation.aggregate``: shares of the
step's global counts, so micro-batches and ranks do not change the result).
``cliprange_value=None`` turns clipping off (``loss_t = 0.5 * (v - R)^2``).
"""
from __future__ import annotations

import math

import torch

from .inputs import LossInputs
from .aggregation import aggregate, check_agg_mode, token_share


class ValueLoss:
    """Clipped value loss for a critic engine (``ModelConfig(value_head=True)``).

    Batch fields (per token, log-prob alignment): ``response_mask``, ``old_values`` (the
    critic's values at rollout time) and ``returns``. Metrics: ``vf_loss``,
    ``vf_clip_frac`` (tokens where the clipped term is the larger one), ``vpred_mean``.
    """

    requires_entropy = False
    mask_field = "response_mask"
    required_fields = ("response_mask", "old_values", "returns")

    def __init__(self, cliprange_value: float | None = 0.5, agg_mode: str = "token-mean"):
        if cliprange_value is not None and not (isinstance(cliprange_value, (int, float))
                                                and math.isfinite(cliprange_value) and cliprange_value > 0):
            raise ValueError(f"cliprange_value must be a finite number > 0 (or None to disable), got "
                             f"{cliprange_value!r}")
        self.cliprange_value = cliprange_value
        self.agg_mode = check_agg_mode(agg_mode)

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return ``(loss, metrics)`` for one micro-batch of a critic."""
        vpred = inputs.values
        if vpred is None:
            raise ValueError("ValueLoss needs a critic's values (LossInputs.values); this engine has no value head "
                             "(build it with ModelConfig(value_head=True))")
        missing = [name for name in self.required_fields if name not in inputs.fields]
        if missing:
            raise ValueError(f"ValueLoss needs batch fields {list(self.required_fields)}; missing {missing} "
                             f"(given: {sorted(inputs.fields)})")
        for name in self.required_fields:
            if inputs.fields[name].shape != vpred.shape:
                raise ValueError(f"field {name!r} must have the shape of the values {tuple(vpred.shape)} "
                                 f"(flat, same layout), got {tuple(inputs.fields[name].shape)}")
        vpred = vpred.float()
        mask = inputs.fields["response_mask"].to(vpred.dtype)
        old = inputs.fields["old_values"].to(vpred.dtype)
        returns = inputs.fields["returns"].to(vpred.dtype)
        unclipped = (vpred - returns) ** 2
        if self.cliprange_value is None:
            per_token, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
        else:
            # clamp(v, old - c, old + c), not old + clamp(v - old, -c, c): the latter is not exactly v
            # in float32 for an in-range v, which would count it as clipped.
            vclipped = torch.clamp(vpred, old - self.cliprange_value, old + self.cliprange_value)
            clipped_sq = (vclipped - returns) ** 2
            per_token, clipped = torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
        loss = 0.5 * aggregate(per_token, mask, inputs, self.agg_mode)
        return loss, {"vf_loss": loss.detach(), "vf_clip_frac": token_share(clipped.float(), mask, inputs),
                      "vpred_mean": token_share(vpred, mask, inputs)}
