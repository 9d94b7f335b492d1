"""The advantage estimators' arithmetic (registered, with what each needs, in
trainer/algos/estimators.py): from one rollout's rewards to per-token advantages. Groups are
consecutive runs of ``group_size`` completions of one prompt.

- ``grpo``: (r - group mean) / (group std + eps) (``norm_adv_by_std=false``: no division).
- ``dr_grpo``: r - group mean; the loss aggregates with a constant normaliser
  (``seq-mean-token-sum-norm``), "Understanding R1-Zero-like training" (Liu et al., 2025).
- ``rloo``: r - mean of the group's OTHER rewards (leave-one-out baseline).
- ``reinforce_plus_plus``: per-token reward = -kl_coef * (logp_old - logp_ref), plus the
  score at the last response token; returns are reward-to-go sums, normalised over every
  response token of the batch (all ranks). Its baseline is the batch, not the group.

A group whose rewards are all equal gets zero advantage (never NaN) from the group
estimators; reinforce_plus_plus gives zero when the whole batch is constant. A completion without
a token to train on (empty: an aborted generation) is no sample: the group estimators leave it
out of its group's statistics (advantage 0; a group with fewer than 2 others: all 0), so the
others' advantages are those of the group without it.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# Added to the std before dividing: a constant group has std 0 and must give 0, not NaN.
STD_EPS = 1e-6
# Added to the variance in reinforce_plus_plus' whitening (verl's masked_whiten).
WHITEN_EPS = 1e-8


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo", norm_by_std: bool = True,
                     eps: float = STD_EPS, present: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per completion for the group estimators (grpo, dr_grpo, rloo); ``present``
    (bool per completion, None: all): the completions that are samples, the others left out of
    their group (advantage 0)."""
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator: got {estimator!r}; group estimators: {', '.join(GROUP_ESTIMATORS)}")
    if group_size < 2:
        raise ValueError(f"group_size: got {group_size}; a group needs at least 2 completions for a baseline")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} values is not a multiple of group_size={group_size}")
    if present is not None and not bool(present.all()):
        return _advantages_of_present(rewards, group_size, estimator, norm_by_std, eps, present)
    groups = rewards.reshape(-1, group_size).double()
    centred = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        # r_i - (sum - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)
        centred = centred * (group_size / (group_size - 1))
    elif estimator == "grpo" and norm_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).float()


def _advantages_of_present(rewards: torch.Tensor, group_size: int, estimator: str, norm_by_std: bool, eps: float,
                           present: torch.Tensor) -> torch.Tensor:
    """:func:`group_advantages` over each group's ``present`` completions only (n of them): the
    same arithmetic with n for the group size; 0 for the others and in a group with n < 2."""
    groups = rewards.reshape(-1, group_size).double()
    kept = present.reshape(-1, group_size).double()
    n = kept.sum(dim=1, keepdim=True)
    mean = (groups * kept).sum(dim=1, keepdim=True) / n.clamp_min(1.0)
    centred = (groups - mean) * kept
    has_baseline = n >= 2
    if estimator == "rloo":
        centred = centred * (n / (n - 1).clamp_min(1.0))
    elif estimator == "grpo" and norm_by_std:
        std = ((centred ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp_min(1.0)).sqrt()
        centred = centred / (std + eps)
    return torch.where(has_baseline, centred, torch.zeros_like(centred)).reshape(-1).float()


def sum_on_one_rank(values: list[float]) -> list[float]:
    """The ``sum_over_ranks`` of a single process: the values themselves."""
    return values


def reinforce_plus_plus_advantages(rewards: Sequence[float], masks: Sequence[torch.Tensor],
                                   kl: Sequence[torch.Tensor] | None, kl_coef: float,
                                   sum_over_ranks: Callable[[list[float]], list[float]] = sum_on_one_rank
                                   ) -> list[torch.Tensor]:
    """Per-token advantages, one flat tensor per sequence (in the engine's alignment).

    ``masks[i]`` marks sequence i's response positions; ``kl[i]`` is the per-token
    logp_old - logp_ref (None: no KL term). Returns are whitened with the mean and unbiased
    variance over every response token of the batch; ``sum_over_ranks`` sums the moments
    over ranks so every rank uses the same statistics.
    """
    returns = []
    for token_rewards, mask in zip(token_level_rewards(rewards, masks, kl, kl_coef), masks):
        # Reward-to-go (gamma = 1): the sum over this and every later response token.
        returns.append(torch.flip(torch.cumsum(torch.flip(token_rewards, [0]), 0), [0]) * mask.double())
    return whiten(returns, masks, sum_over_ranks)


def token_level_rewards(rewards: Sequence[float], masks: Sequence[torch.Tensor],
                        kl: Sequence[torch.Tensor] | None, kl_coef: float) -> list[torch.Tensor]:
    """Per-token rewards (float64, one flat tensor per sequence): ``-kl_coef * kl`` on every
    response position (no KL term when ``kl`` is None) plus the sequence's score at its
    last response position."""
    out = []
    for i, (score, mask) in enumerate(zip(rewards, masks)):
        on_response = mask.bool()
        mask = mask.double()
        # where, not a product: a NaN off the response (0 * NaN = NaN) would spread through whitening.
        token_rewards = torch.where(on_response, -kl_coef * kl[i].double(), 0.0) if kl is not None \
            else torch.zeros_like(mask)
        positions = mask.nonzero()
        if positions.numel():
            token_rewards[positions[-1, 0]] += float(score)
        out.append(token_rewards)
    return out


def whiten(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
           sum_over_ranks: Callable[[list[float]], list[float]] = sum_on_one_rank) -> list[torch.Tensor]:
    """``(v - mean) / sqrt(var + eps)`` over every masked token of the batch (verl's
    masked_whiten: unbiased variance), zero off the masks; ``sum_over_ranks`` sums the
    moments over ranks so every rank uses the same statistics. One float32 tensor per sequence."""
    values = [v.double() * m.double() for v, m in zip(values, masks)]
    total = sum(float(v.sum()) for v in values)
    squares = sum(float((v ** 2).sum()) for v in values)
    count = sum(float(m.sum()) for m in masks)
    total, squares, count = sum_over_ranks([total, squares, count])
    mean = total / max(count, 1.0)
    var = max(squares - count * mean ** 2, 0.0) / max(count - 1.0, 1.0)
    scale = (var + WHITEN_EPS) ** -0.5
    return [((v - mean) * scale * m.double()).float() for v, m in zip(values, masks)]
