"""The actor's policy losses ``algo.actor.policy_loss`` names (engines/losses/), each with
what it needs declared next to it.

Every policy loss reads the rollout's advantages, the reference log-probs when its KL term is
on (``algo.actor.kl_coef > 0`` and no KL in the reward) and the old log-probs only when a
rollout feeds more than one optimizer step (with one, the policy that sampled is the one
trained: the ratio is 1 and the loss uses its own log-probs, ``on_policy``). Adding one: a
PPOLoss subclass replacing ``_policy_gradient`` (as GSPOLoss does), its :class:`PolicyLoss` entry
below (a built-in) or, from the user's own code, the config value ``path/to/file.py:NAME`` /
``package.module:NAME`` naming such an entry (loaded like ``reward.fn``, checked on a small
made-up batch before the job starts); and a test against a hand-written reference (values and
gradients).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Real

import torch

from polyfsdp.engines.losses import DEFAULT_CLIP_RATIO_HIGH, GSPO_CLIP_RATIO_HIGH, GSPO_CLIP_RATIO_LOW, \
    PPO_AGG_MODES, GSPOLoss, LossInputs, PPOLoss, is_token_separable

from ..errors import ConfigError


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: the class, its default clip range (``algo.actor.clip_ratio_low``
    / ``_high`` null), the aggregation it needs (None: ``algo.actor.agg_mode``), whether it takes
    dual-clip and the sampler corrections (truncated and masked importance sampling), its
    constructor options and its docs line."""

    name: str
    loss_class: type
    summary: str
    clip_ratio_low: float
    clip_ratio_high: float
    agg_mode: str | None = None
    per_token_corrections: bool = True  # dual_clip_c, rollout_correction.tis_cap / mask_* (and tis_cap: auto)
    options: dict = field(default_factory=dict)

    def __call__(self, **settings) -> PPOLoss:
        """The loss with the job's settings (PPOLoss' keywords) and this entry's options."""
        return self.loss_class(**settings, **self.options)

    def problem(self) -> str | None:
        """What is wrong with this entry's declarations (a user's), in words; None if nothing."""
        if not (isinstance(self.loss_class, type) and issubclass(self.loss_class, PPOLoss)):
            return f"loss_class must be a subclass of polyfsdp.engines.losses.PPOLoss, got {self.loss_class!r}"
        for key, value, lowest, below_one in (("clip_ratio_low", self.clip_ratio_low, 0.0, True),
                                              ("clip_ratio_high", self.clip_ratio_high, 0.0, False)):
            if isinstance(value, bool) or not isinstance(value, Real) or not value >= lowest or \
                    (below_one and not value < 1.0):
                return f"{key} must be a number in [0, 1), got {value!r}" if below_one else \
                    f"{key} must be a number >= 0, got {value!r}"
        if self.agg_mode is not None and self.agg_mode not in PPO_AGG_MODES:
            return f"agg_mode must be None or one of {', '.join(PPO_AGG_MODES)}, got {self.agg_mode!r}"
        if not isinstance(self.per_token_corrections, bool):
            return f"per_token_corrections must be True or False, got {self.per_token_corrections!r}"
        if not isinstance(self.options, dict):
            return f"options must be a dict of the loss class's keyword arguments, got {self.options!r}"
        return None


POLICY_LOSSES: dict[str, PolicyLoss] = {p.name: p for p in (
    PolicyLoss("ppo", PPOLoss, "PPO's clipped per-token ratio (dual-clip, TIS)", 0.2, DEFAULT_CLIP_RATIO_HIGH),
    PolicyLoss("gspo", GSPOLoss, "GSPO: one clipped ratio per sequence, exp(mean token log-ratio); mean over "
               "sequences", GSPO_CLIP_RATIO_LOW, GSPO_CLIP_RATIO_HIGH, agg_mode="seq-mean-token-mean",
               per_token_corrections=False, options={"sequence_level": True}),
    PolicyLoss("gspo_token", GSPOLoss, "GSPO-token: the sequence ratio's value with per-token gradients and "
               "advantages", GSPO_CLIP_RATIO_LOW, GSPO_CLIP_RATIO_HIGH, agg_mode="seq-mean-token-mean",
               per_token_corrections=False, options={"sequence_level": False}),
)}


_loaded: dict[str, PolicyLoss] = {}  # user losses by spec: a file is imported once


def policy_loss_entry(spec: str, key: str = "algo.actor.policy_loss") -> PolicyLoss:
    """The policy loss ``spec`` names: a built-in, ``path/to/file.py:NAME`` or ``module:NAME`` (a
    :class:`PolicyLoss`); anything else, or an entry declaring impossible defaults, is one
    ConfigError naming ``key``."""
    from ..config.plugins import load_registered

    entry = load_registered(spec, key, POLICY_LOSSES, PolicyLoss, "policy loss",
                            "a policy loss; register it as PolicyLoss(name, LossClass, summary, clip_ratio_low, "
                            "clip_ratio_high, ...) from polyfsdp.trainer.algos.policy_losses", _loaded)
    problem = None if spec in POLICY_LOSSES else entry.problem()
    if problem:
        raise ConfigError(f"{key}={spec}: {problem}")
    return entry


class UserLoss:
    """A user's policy loss as the engine calls it: its attributes (``required_fields``,
    ``on_policy``, ...) are the loss's, and an exception or ``sys.exit`` inside it is one line
    naming ``spec`` and the user's file:line, as for a user's estimator."""

    def __init__(self, loss: PPOLoss, spec: str, key: str = "algo.actor.policy_loss"):
        self.user_loss, self.who = loss, f"{key}={spec}"

    def __getattr__(self, name: str):  # only for names not set here
        if name == "user_loss":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.user_loss, name)

    def __call__(self, inputs: LossInputs):
        from ..rewards.reward_fn import call_user_code

        from ..errors import RewardError

        where = f"(a micro-batch of {inputs.offsets.numel() - 1} sequences)"
        result = call_user_code(lambda: self.user_loss(inputs), self.who, where, None, "")
        problem = metrics_problem(result)
        if problem:
            raise RewardError(f"{self.who}: {problem} {where}")
        return result


def metrics_problem(result) -> str | None:
    """What is wrong with the metrics of a loss's ``(loss, metrics)`` (the engine sums each as a
    number: a string there was ``TypeError: new(): invalid data type 'str'`` deep in it), or None."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        return None  # the shape is the engine's and the made-up batch's to report
    for key, value in result[1].items():
        number = isinstance(value, Real) or (
            torch.is_tensor(value) and value.numel() == 1 and not value.is_complex())
        if not isinstance(key, str) or not number:
            shown = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else \
                f"a {type(value).__name__}"
            return (f"the metric {key!r} is {shown} ({str(value)[:40]!r}); every metric must be a number or a "
                    f"one-element tensor")
    return None


class SeparableUserLoss(UserLoss):
    """A :class:`UserLoss` whose class declares ``token_separable = True`` (the declaration counts
    only on the called object's own class, engines/losses/inputs.py)."""

    token_separable = True


def wrap_user_loss(loss: PPOLoss, spec: str) -> UserLoss:
    """``loss`` (built from the user's entry ``spec``) with its failures reported as one line."""
    return (SeparableUserLoss if is_token_separable(loss) else UserLoss)(loss, spec)


def check_on_a_made_up_batch(loss: UserLoss, key: str = "algo.actor.policy_loss") -> None:
    """A user's loss, as the job built it, on two short made-up sequences, backward included: a
    loss that raises or returns anything but ``(a 0-d tensor with a gradient, a dict of metrics)``
    is one ConfigError naming ``key`` before any model is built."""
    from ..errors import RewardError
    from ..rewards.reward_fn import call_user_code

    who, where = loss.who, "(on a made-up batch of 2 sequences, before the job starts)"
    inputs = _made_up_inputs(loss)
    try:
        result = call_user_code(lambda: _loss_and_backward(loss.user_loss, inputs), who, where, None, "")
    except RewardError as exc:
        raise ConfigError(str(exc)) from None
    if not (isinstance(result, tuple) and len(result) == 2 and torch.is_tensor(result[0])
            and result[0].dim() == 0 and isinstance(result[1], dict)):
        raise ConfigError(f"{who}: the loss returned {type(result).__name__}; its __call__ must return (loss, "
                          f"metrics): a 0-d tensor and a dict {where}")
    problem = metrics_problem(result)
    if problem:
        raise ConfigError(f"{who}: {problem} {where}")
    if inputs.log_probs.grad is None or not torch.isfinite(inputs.log_probs.grad).all():
        raise ConfigError(f"{who}: the loss has no finite gradient with respect to the log-probs; build it from "
                          f"log_probs {where}")


def _loss_and_backward(loss, inputs: LossInputs):
    result = loss(inputs)
    if isinstance(result, tuple) and result and torch.is_tensor(result[0]) and result[0].requires_grad:
        result[0].backward()
    return result


def _made_up_inputs(loss) -> LossInputs:
    """Two sequences (3 and 4 positions, the last of each outside the response) with every field
    the loss declares, log-probs a leaf that requires a gradient."""
    gen = torch.Generator().manual_seed(0)  # its own generator: the job's random state is untouched
    offsets = torch.tensor([0, 3, 7])
    log_probs = (-torch.rand(7, generator=gen) - 0.1).requires_grad_()
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])

    def near() -> torch.Tensor:
        return (log_probs.detach() + 0.1 * torch.randn(7, generator=gen)).clamp(max=0.0)

    made_up = {"response_mask": mask, "advantages": torch.tensor([1.0] * 3 + [-1.0] * 4), "old_log_probs": near(),
               "ref_log_probs": near(), "rollout_log_probs": near()}
    fields = {name: made_up.get(name, torch.zeros(7)) for name in getattr(loss, "required_fields", ())}
    entropy = torch.rand(7, generator=gen) if getattr(loss, "requires_entropy", True) else None
    return LossInputs(log_probs=log_probs, entropy=entropy, fields=fields, offsets=offsets,
                      global_num_tokens=float(mask.sum()), global_num_seqs=2)
