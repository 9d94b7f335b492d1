"""Metrics of an evaluation with several samples per prompt: mean@n, pass@k (the unbiased
estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code") and
maj@n (majority vote over comparable answers), overall and per ``data_source``.

Pure functions of the per-prompt rewards and answers: the trainer and ``polyfsdp-eval``
gather those from every rank and call :func:`evaluation_metrics`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass
class PromptSamples:
    """The ``n`` samples of one evaluation prompt: each reward and answer (None: no answer
    could be read from that completion, or the reward function names none)."""

    index: int
    data_source: str
    rewards: list[float]
    answers: list[str | None]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n``
    (``c`` of them correct) is correct: ``1 - C(n - c, k) / C(n, k)``, as a product that
    neither overflows nor loses precision."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def k_values(n: int) -> list[int]:
    """The k reported for ``n`` samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority_reward(rewards: list[float], answers: list[str | None]) -> float:
    """The reward of the most frequent answer (ties: the one seen first; its samples' mean
    reward); 0.0 when no sample has an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    chosen = [r for r, a in zip(rewards, answers) if a == winner]
    return sum(chosen) / len(chosen)


def _metrics(prompts: list[PromptSamples], pass_threshold: float) -> dict[str, float]:
    n = len(prompts[0].rewards)
    rewards = [r for p in prompts for r in p.rewards]
    out = {"reward": sum(rewards) / len(rewards)}
    if n == 1:
        return out
    out[f"mean@{n}"] = out["reward"]
    for k in k_values(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(r >= pass_threshold for r in p.rewards), k)
                               for p in prompts) / len(prompts)
    if any(a is not None for p in prompts for a in p.answers):
        out[f"maj@{n}"] = sum(majority_reward(p.rewards, p.answers) for p in prompts) / len(prompts)
    return out


def evaluation_metrics(prompts: list[PromptSamples], pass_threshold: float = 1.0) -> dict[str, float]:
    """``reward`` (the mean over every sample) and, with n > 1 samples per prompt, ``mean@n``,
    ``pass@k`` (a sample counts as correct when its reward >= ``pass_threshold``) and
    ``maj@n`` (when answers are known); with several data sources, each again as
    ``<data_source>/<metric>``."""
    if not prompts or len({len(p.rewards) for p in prompts}) != 1 or not prompts[0].rewards:
        raise ValueError("evaluation metrics need the same number (>= 1) of samples for every prompt")
    out = _metrics(prompts, pass_threshold)
    sources = sorted({p.data_source for p in prompts})
    if len(sources) > 1:
        for source in sources:
            mine = [p for p in prompts if p.data_source == source]
            out.update({f"{source or 'unnamed'}/{k}": v for k, v in _metrics(mine, pass_threshold).items()})
    return out
