"""The advantage estimators ``algo.adv_estimator`` names, each with what it needs declared
next to it. trainer/algos/rl_step.py reads only these declarations: it computes old and reference
log-probs, a critic's values and the KL-in-reward term when an estimator asks for them.

Adding one: a function ``(AdvantageInputs) -> Advantages`` (its hyperparameters in
``inputs.params``, :class:`EstimatorParams`, never the job's config) decorated with :func:`estimator`,
its entry in ``ESTIMATORS`` (a built-in) or, from the user's own code, the config value
``path/to/file.py:NAME`` / ``package.module:NAME`` naming the decorated function (loaded like
``reward.fn``); and a test against hand-computed advantages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .advantages import GROUP_ESTIMATORS, group_advantages, reinforce_plus_plus_advantages, sum_on_one_rank
from .gae import gae_advantages

# The aggregation Dr. GRPO's advantages assume: each sequence's token losses summed, over a
# constant (the generation budget) instead of the sequence's length.
DR_GRPO_AGG_MODE = "seq-mean-token-sum-norm"


@dataclass(frozen=True)
class EstimatorParams:
    """The estimators' own hyperparameters, taken from the job's config once per step:
    ``norm_adv_by_std`` (algo.actor.norm_adv_by_std: the group estimators divide by the group's
    std) and GAE's discounts ``gamma`` and ``lam`` (algo.critic.gamma, lam; 1 without a critic)."""

    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0

    @classmethod
    def of(cls, algo) -> "EstimatorParams":
        """The hyperparameters the AlgoSection ``algo`` sets."""
        critic = algo.critic
        discounts = (critic.gamma, critic.lam) if critic is not None else (1.0, 1.0)
        return cls(algo.actor.norm_adv_by_std, *discounts)


@dataclass(frozen=True)
class AdvantageInputs:
    """One rollout on this rank, as the estimators see it: one entry per sequence, groups of
    ``group_size`` consecutive sequences, per-token tensors in the engine's alignment, and the
    estimators' hyperparameters (``params``)."""

    rewards: Sequence[float]                      # each sequence's score
    masks: Sequence[torch.Tensor]                 # its response positions (0/1)
    group_size: int
    # Log-probs are computed on the response positions only (0 elsewhere: the LM head runs there).
    old_log_probs: Sequence[torch.Tensor] | None  # when the estimator or the loss needs them
    ref_log_probs: Sequence[torch.Tensor] | None  # when there is a reference (kl_coef > 0)
    values: Sequence[torch.Tensor] | None         # the critic's, when the estimator needs one
    kl: Sequence[torch.Tensor] | None             # logp_old - logp_ref per token when the KL is in the reward
    kl_coef: float
    params: EstimatorParams = EstimatorParams()
    sum_over_ranks: Callable[[list[float]], list[float]] = sum_on_one_rank
    # The job's whole AlgoSection, still passed for estimators written before ``params``; the
    # built-ins never read it (``inputs.algo.actor.norm_adv_by_std`` is ``inputs.params.norm_adv_by_std``,
    # ``inputs.algo.critic.gamma`` / ``lam`` are ``inputs.params.gamma`` / ``lam``).
    algo: object = None


@dataclass(frozen=True)
class Advantages:
    """Per-token advantages, one flat tensor per sequence; ``returns`` (a critic's targets)
    when the estimator trains a critic."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what it needs.

    ``needs_critic``: the job builds a critic (``algo.critic``), its values reach the estimator
    and it must return ``returns``. ``kl_in_reward``: the KL penalty goes into the per-token
    reward (so old and reference log-probs are computed and the loss has no KL term); a critic
    estimator also does so with ``algo.critic.kl_in_reward``. ``needs_old_log_probs``: the
    estimator reads them itself. ``agg_mode``: the loss aggregation its advantages assume (None:
    ``algo.actor.agg_mode``). ``multi_turn``: it handles environment turns (masked tokens inside
    the response). ``summary``: the line of the docs' table (docs/algorithms.md, configs/algo/grpo.yaml).
    """

    name: str
    compute: Callable[[AdvantageInputs], Advantages]
    summary: str
    needs_critic: bool = False
    kl_in_reward: bool = False
    needs_old_log_probs: bool = False
    agg_mode: str | None = None
    multi_turn: bool = True

    def __call__(self, inputs: AdvantageInputs) -> Advantages:
        return self.compute(inputs)


def needs_text(est: Estimator) -> str:
    """What ``est`` declares it needs, in words (the column of docs/algorithms.md's table)."""
    parts = (["a critic (algo.critic)"] if est.needs_critic else []) + \
        (["old and reference log-probs (the KL in the reward)"] if est.kl_in_reward else []) + \
        (["old log-probs"] if est.needs_old_log_probs else []) + \
        ([f"agg_mode {est.agg_mode}"] if est.agg_mode else []) + \
        ([] if est.multi_turn else ["single-turn rollouts"])
    return "; ".join(parts) or "rewards only"


def estimator(name: str, summary: str, **needs) -> Callable[[Callable[[AdvantageInputs], Advantages]], Estimator]:
    """Decorator: ``@estimator("name", "one line", needs_critic=..., ...)`` turns the function into
    an :class:`Estimator` (see its fields for what ``needs`` may declare)."""
    return lambda fn: Estimator(name=name, compute=fn, summary=summary, **needs)


def _per_token(inputs: AdvantageInputs, name: str) -> Advantages:
    """A group estimator's one advantage per sequence, on each of its positions; a sequence
    without a response token to train on (an empty completion) is left out of its group."""
    present = torch.tensor([bool(m.any()) for m in inputs.masks])
    adv = group_advantages(torch.tensor(inputs.rewards, dtype=torch.float32), inputs.group_size, name,
                           inputs.params.norm_adv_by_std, present=present)
    return Advantages([torch.full((len(m),), float(a)) for m, a in zip(inputs.masks, adv)])


@estimator("grpo", "(r - group mean) / group std (algo.actor.norm_adv_by_std=false: no division)")
def grpo(inputs: AdvantageInputs) -> Advantages:
    return _per_token(inputs, "grpo")


@estimator("dr_grpo", "r - group mean, losses summed per sequence over a constant (max_new_tokens): Dr. GRPO",
           agg_mode=DR_GRPO_AGG_MODE)
def dr_grpo(inputs: AdvantageInputs) -> Advantages:
    return _per_token(inputs, "dr_grpo")


@estimator("rloo", "r - mean of the group's other rewards (leave-one-out baseline)")
def rloo(inputs: AdvantageInputs) -> Advantages:
    return _per_token(inputs, "rloo")


@estimator("reinforce_plus_plus", "reward-to-go with a per-token k1 KL penalty (kl_coef) in the reward, "
           "whitened over the batch", kl_in_reward=True)
def reinforce_plus_plus(inputs: AdvantageInputs) -> Advantages:
    return Advantages(reinforce_plus_plus_advantages(inputs.rewards, inputs.masks, inputs.kl, inputs.kl_coef,
                                                     sum_over_ranks=inputs.sum_over_ranks))


# Environment turns (mask 0 inside the response) are skipped: the last assistant token before
# one bootstraps from the value of the next assistant token, as in verl's multi-turn GAE.
@estimator("gae", "token-level GAE over the response from a learned critic (algo=ppo; algo.critic.gamma, lam)",
           needs_critic=True)
def gae(inputs: AdvantageInputs) -> Advantages:
    params = inputs.params
    advantages, returns = gae_advantages(inputs.rewards, inputs.masks, inputs.values, params.gamma, params.lam,
                                         inputs.kl, inputs.kl_coef, sum_over_ranks=inputs.sum_over_ranks)
    return Advantages(advantages, returns)


# The built-ins, in the order the docs list them.
ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (grpo, dr_grpo, rloo, reinforce_plus_plus, gae)}
assert set(GROUP_ESTIMATORS) <= set(ESTIMATORS)

_loaded: dict[str, Estimator] = {}  # user estimators by spec: a file is imported once


def resolve_estimator(spec: str, key: str = "algo.adv_estimator") -> Estimator:
    """The estimator ``spec`` names: a built-in, ``path/to/file.py:NAME`` or ``module:NAME``
    (an :func:`estimator`-decorated function); anything else is one ConfigError naming ``key``."""
    from ..config.plugins import load_registered

    return load_registered(spec, key, ESTIMATORS, Estimator, "estimator",
                           "an estimator; decorate it with @polyfsdp.trainer.algos.estimators.estimator(name, "
                           "summary, ...)", _loaded)
