"""PPO's token-level GAE (Schulman et al., 2016) over a rollout's response tokens, and the
critic's explained variance.

Per sequence, over its response positions ``k = 0 .. n-1`` (the engine's alignment: position
``t`` holds the value of the state before token ``t + 1``, trainer/data/batch.py)::

    r_k     = -kl_coef * (logp_old - logp_ref)_k  [kl_in_reward]  + score at k = n - 1
    delta_k = r_k + gamma * V_{k+1} - V_k            (V_n = 0: the episode ends)
    A_k     = delta_k + gamma * lam * A_{k+1}        (A_n = 0)
    returns = A + V;  advantages = whiten(A) over every response token of the batch (all ranks)

Positions off the response mask are skipped (they carry the next response value and
advantage through, as verl's ``compute_gae_advantage_return`` does) and come out 0.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from .advantages import sum_on_one_rank, token_level_rewards, whiten


def gae_advantages(rewards: Sequence[float], masks: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                   gamma: float, lam: float, kl: Sequence[torch.Tensor] | None = None, kl_coef: float = 0.0,
                   sum_over_ranks: Callable[[list[float]], list[float]] = sum_on_one_rank
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(advantages, returns)``, one flat float32 tensor per sequence in the engine's
    alignment. ``masks[i]``: sequence i's response positions; ``values[i]``: the critic's
    values; ``kl[i]``: per-token ``logp_old - logp_ref`` (None: no KL in the reward)."""
    if not masks:
        return [], []
    token_rewards = token_level_rewards(rewards, masks, kl, kl_coef)
    # Right-padded (B, L): padding is off the mask, so it only carries zeros through.
    r = pad_sequence(token_rewards, batch_first=True)
    v = pad_sequence([x.double() for x in values], batch_first=True)
    m = pad_sequence([x.double() for x in masks], batch_first=True)
    adv = torch.zeros_like(v)
    next_value = torch.zeros(v.shape[0], dtype=torch.float64)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
        last_gae = torch.where(m[:, t] > 0, gae, last_gae)
        adv[:, t] = last_gae
    adv = adv * m
    lengths = [len(x) for x in masks]
    raw = [adv[i, :n] for i, n in enumerate(lengths)]
    returns = [((a + v[i, :n]) * m[i, :n]).float() for i, (a, n) in enumerate(zip(raw, lengths))]
    return whiten(raw, masks, sum_over_ranks), returns


def explained_variance(values: Sequence[torch.Tensor], returns: Sequence[torch.Tensor],
                       masks: Sequence[torch.Tensor],
                       sum_over_ranks: Callable[[list[float]], list[float]] = sum_on_one_rank) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over every response token of the batch
    (all ranks): 1 is a perfect critic, 0 no better than a constant, negative worse. 0 when
    the returns are constant."""
    moments = [0.0] * 5
    for v, r, m in zip(values, returns, masks):
        m = m.double()
        err = (r.double() - v.double()) * m
        r = r.double() * m
        for j, x in enumerate((float(m.sum()), float(r.sum()), float((r ** 2).sum()), float(err.sum()),
                               float((err ** 2).sum()))):
            moments[j] += x
    count, r_sum, r_sq, e_sum, e_sq = sum_over_ranks(moments)
    if count < 1:
        return 0.0
    var_r = r_sq / count - (r_sum / count) ** 2
    var_e = e_sq / count - (e_sum / count) ** 2
    return 1.0 - var_e / var_r if var_r > 1e-12 else 0.0
