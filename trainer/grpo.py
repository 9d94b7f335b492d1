"""One GRPO step: sample a group of completions per prompt, score them, turn rewards into
advantages (trainer/advantages.py), and feed the rollout to one or more clipped
policy-gradient steps (trainer/grpo_updates.py) with a KL penalty towards the reference."""
from __future__ import annotations

import time
from typing import Callable

import torch

from polyfsdp.backends.distributed import all_reduce_sum, sum_over_replicas

from .advantages import group_advantages, reinforce_plus_plus_advantages
from .batch import build_batch, response_field, response_mask
from .grpo_sampling import sample_groups
from .grpo_updates import mini_batch_plan, old_and_ref_log_probs, run_updates, summarise_updates
from .multi_turn import rollout_metrics
from .rewards import mean_over_ranks
from .task import Example


__all__ = ["grpo_step", "group_advantages"]


def _advantages(algo, roll, pairs, old, ref, device) -> list[torch.Tensor]:
    """Per-token advantages, one flat tensor per sequence, for ``algo.adv_estimator``."""
    g = algo.grpo
    masks = [response_mask(*pair) for pair in pairs]
    if algo.adv_estimator == "reinforce_plus_plus":
        kl = [o - r for o, r in zip(old, ref)] if ref is not None and g.kl_coef > 0 else None
        return reinforce_plus_plus_advantages(roll.rewards, masks, kl, g.kl_coef,
                                              sum_over_ranks=lambda v: sum_over_replicas(v, device))
    adv = group_advantages(torch.tensor(roll.rewards, dtype=torch.float32), g.group_size, algo.adv_estimator,
                           g.norm_adv_by_std)
    return [torch.full((len(m),), float(a)) for m, a in zip(masks, adv)]


def grpo_step(policy, ref, tokenizer, examples: list[Example], algo, loss_fn, sample_seed: int, shuffle_seed: int = 0,
              mini_batches: int = 1, scorer=None, more_examples: Callable[[int], list[Example]] | None = None,
              sampler=None) -> dict:
    """Train one GRPO step on this rank's prompts ``examples``; ``algo`` is the AlgoSection.
    ``sample_seed`` seeds the sampling and ``shuffle_seed`` the mini-batch order, so a
    resumed run draws the same completions and updates; ``mini_batches`` optimizer steps
    per epoch. ``more_examples(k)`` gives the k-th extra prompt batch for group filtering;
    ``sampler`` is the rollout engine (trainer/rollout_engines.py)."""
    t0 = time.perf_counter()
    g = algo.grpo
    policy.backend.manual_seed(sample_seed)
    sampled = sample_groups(policy, tokenizer, examples, g, algo.rollout_correction.needs_rollout_log_probs,
                            scorer, more_examples, sampler)
    roll, first = sampled.kept, sampled.first
    t_gen = time.perf_counter() - t0
    metrics = _reward_metrics(first, policy.device)
    metrics.update(sampled.metrics)
    pairs = roll.pairs()
    lengths = [len(pair[0]) + len(pair[1]) for pair in pairs]
    token_fields: dict[str, list[torch.Tensor]] = {}
    if roll.log_probs is not None:
        token_fields["rollout_log_probs"] = [response_field(p, lp) for p, lp in zip(roll.prompt_ids, roll.log_probs)]
    updates = []
    if pairs:
        pad_mode = policy.engine_config.pad_mode
        batch = build_batch(pairs, pad_mode, tokenizer.pad_token_id)
        # One update per rollout: the policy that sampled is the one trained, ratio == 1, and
        # the loss uses its own log-probs (on_policy); the estimator may still need them.
        need_old = not loss_fn.on_policy or (algo.adv_estimator == "reinforce_plus_plus" and ref is not None)
        old, ref_lp = old_and_ref_log_probs(policy, ref, batch, g.temperature, need_old, token_fields)
        token_fields["advantages"] = _advantages(algo, roll, pairs, old, ref_lp, policy.device)
        plan = mini_batch_plan(len(pairs) // g.group_size, g.group_size, mini_batches,
                               g.epochs, shuffle_seed)
        updates = run_updates(policy, pairs, token_fields, plan, loss_fn, tokenizer.pad_token_id, g.temperature)
        metrics.update(summarise_updates(updates))
    metrics.update({
        "tokens": float(sum(lengths)),
        "gen_time_s": t_gen,
        "step_time_s": time.perf_counter() - t0,
    })
    metrics.update(mean_over_ranks(first.reward_metrics))
    metrics.update(rollout_metrics(first.rollout_metrics))
    if len(updates) > 1:
        metrics["update_metrics"] = updates
    return metrics


def _reward_metrics(roll, device) -> dict:
    """Mean, std, solved fraction and response length of a rollout's completions (all ranks)."""
    rewards = torch.tensor(roll.rewards, dtype=torch.float32)
    resp_len = float(sum(len(r) for r in roll.response_ids))
    solved = float(sum(r == 1.0 for r in roll.rewards))
    reward_sum, reward_sq, count, resp_sum, solved_sum = all_reduce_sum(
        [float(rewards.sum()), float((rewards ** 2).sum()), float(rewards.numel()), resp_len, solved], device)
    mean = reward_sum / count
    return {"reward": mean, "reward_std": max(reward_sq / count - mean ** 2, 0.0) ** 0.5,
            "solved": solved_sum / count, "response_len": resp_sum / count}
