"""The actor's policy losses ``algo.actor.policy_loss`` names (engines/losses/), each with
what it needs declared next to it.

Every policy loss reads the rollout's advantages, the reference log-probs when its KL term is
on (``algo.actor.kl_coef > 0`` and no KL in the reward) and the old log-probs only when a
rollout feeds more than one optimizer step (with one, the policy that sampled is the one
trained: the ratio is 1 and the loss uses its own log-probs, ``on_policy``). Adding one: a loss
class taking PPOLoss' settings, its :class:`PolicyLoss` entry below, a test against a
hand-written reference (values and gradients).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from polyfsdp.engines.losses import DEFAULT_CLIP_RATIO_HIGH, GSPO_CLIP_RATIO_HIGH, GSPO_CLIP_RATIO_LOW, GSPOLoss, \
    PPOLoss

from ..errors import ConfigError


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: the class, its default clip range (``algo.actor.clip_ratio_low``
    / ``_high`` null), the aggregation it needs (None: ``algo.actor.agg_mode``), whether it takes
    dual-clip and truncated importance sampling, its constructor options and its docs line."""

    name: str
    loss_class: type
    summary: str
    clip_ratio_low: float
    clip_ratio_high: float
    agg_mode: str | None = None
    per_token_corrections: bool = True  # dual_clip_c, rollout_correction.tis_cap
    options: dict = field(default_factory=dict)


POLICY_LOSSES: dict[str, PolicyLoss] = {p.name: p for p in (
    PolicyLoss("ppo", PPOLoss, "PPO's clipped per-token ratio (dual-clip, TIS)", 0.2, DEFAULT_CLIP_RATIO_HIGH),
    PolicyLoss("gspo", GSPOLoss, "GSPO: one clipped ratio per sequence, exp(mean token log-ratio); mean over "
               "sequences", GSPO_CLIP_RATIO_LOW, GSPO_CLIP_RATIO_HIGH, agg_mode="seq-mean-token-mean",
               per_token_corrections=False, options={"sequence_level": True}),
    PolicyLoss("gspo_token", GSPOLoss, "GSPO-token: the sequence ratio's value with per-token gradients and "
               "advantages", GSPO_CLIP_RATIO_LOW, GSPO_CLIP_RATIO_HIGH, agg_mode="seq-mean-token-mean",
               per_token_corrections=False, options={"sequence_level": False}),
)}


def policy_loss_entry(name: str, key: str = "algo.actor.policy_loss") -> PolicyLoss:
    """The registered policy loss ``name``; anything else is one ConfigError naming ``key``."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    close = difflib.get_close_matches(str(name), POLICY_LOSSES, n=1)
    raise ConfigError(f"{key}: got {name!r}; allowed values: {', '.join(POLICY_LOSSES)}"
                      + (f" (did you mean {close[0]}?)" if close else ""))
