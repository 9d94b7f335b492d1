"""One PPO step with a learned critic (``algo=ppo``), verl's order:

```
sample_groups (grpo_sampling.py)   generate + score, as GRPO does
old log-probs, ref log-probs       policy / reference infer_batch (old only when needed: update-many
                                   or kl_in_reward; else the actor's ratio is 1 by construction)
values                             critic.infer_values (the state before each token, engine alignment)
GAE (gae.py)                       per-token advantages (whitened over the batch, all ranks), returns
critic updates                     run_updates(critic, ValueLoss): epochs x mini-batches
actor updates                      run_updates(policy, PPOLoss) on the same plan, after
                                   algo.ppo.critic_warmup steps of critic-only training
```

Both engines use the mini-batch plan of GRPO's update-many (grpo_updates.py), so a resumed
run reshuffles identically.
"""
from __future__ import annotations

import time
from typing import Callable

from polyfsdp.backends.distributed import sum_over_replicas

from .batch import build_batch, per_sequence, response_field, response_mask
from .gae import explained_variance, gae_advantages
from .grpo import _reward_metrics
from .grpo_sampling import sample_groups
from .grpo_updates import mini_batch_plan, old_and_ref_log_probs, run_updates, summarise_updates
from .rewards import mean_over_ranks
from .task import Example

# Critic metrics that share a name with the actor's get this prefix in the step's record.
CRITIC_PREFIX = "vf_"


def ppo_step(policy, critic, ref, tokenizer, examples: list[Example], algo, actor_loss, value_loss,
             sample_seed: int, shuffle_seed: int = 0, mini_batches: int = 1, train_actor: bool = True,
             scorer=None, more_examples: Callable[[int], list[Example]] | None = None, sampler=None) -> dict:
    """Train one PPO step on this rank's prompts ``examples``; ``algo`` is the AlgoSection,
    ``train_actor=False`` trains only the critic (warm-up). Seeds as in ``grpo_step``."""
    t0 = time.perf_counter()
    g = algo.grpo
    device = policy.device
    policy.backend.manual_seed(sample_seed)
    sampled = sample_groups(policy, tokenizer, examples, g, algo.rollout_correction.needs_rollout_log_probs,
                            scorer, more_examples, sampler)
    roll = sampled.kept
    t_gen = time.perf_counter() - t0
    metrics = _reward_metrics(sampled.first, device)
    metrics.update(sampled.metrics)
    pairs = roll.pairs()
    if pairs:
        metrics.update(_train(policy, critic, ref, tokenizer, roll, pairs, algo, actor_loss, value_loss,
                              mini_batches, shuffle_seed, train_actor))
    metrics.update({"tokens": float(sum(len(pair[0]) + len(pair[1]) for pair in pairs)), "gen_time_s": t_gen,
                    "step_time_s": time.perf_counter() - t0, "actor_trained": float(train_actor)})
    metrics.update(mean_over_ranks(sampled.first.reward_metrics))
    return metrics


def _train(policy, critic, ref, tokenizer, roll, pairs, algo, actor_loss, value_loss, mini_batches: int,
           shuffle_seed: int, train_actor: bool) -> dict:
    g, p = algo.grpo, algo.ppo
    device = policy.device
    pad_mode = policy.engine_config.pad_mode
    batch = build_batch(pairs, pad_mode, tokenizer.pad_token_id)
    masks = [response_mask(*pair) for pair in pairs]
    token_fields = {}
    if roll.log_probs is not None:
        token_fields["rollout_log_probs"] = [response_field(a, lp) for a, lp in zip(roll.prompt_ids, roll.log_probs)]
    need_old = not actor_loss.on_policy or (algo.kl_in_reward and ref is not None)
    old, ref_lp = old_and_ref_log_probs(policy, ref, batch, g.temperature, need_old, token_fields)
    # The critic runs with the policy's engine settings (one `engine` group), so the batch fits both.
    values = per_sequence(critic.infer_values(batch)["values"], batch, pad_mode)
    kl = [o - r for o, r in zip(old, ref_lp)] if algo.kl_in_reward and ref_lp is not None else None
    # Batch statistics count each replica once (its SP ranks hold the same rollout).
    over_ranks = lambda v: sum_over_replicas(v, device)  # noqa: E731
    advantages, returns = gae_advantages(roll.rewards, masks, values, p.gamma, p.lam, kl, g.kl_coef,
                                         sum_over_ranks=over_ranks)
    token_fields["advantages"] = advantages
    plan = mini_batch_plan(len(pairs) // g.group_size, g.group_size, mini_batches, g.epochs, shuffle_seed)
    out = _value_metrics(values, returns, masks, over_ranks)
    critic_updates = run_updates(critic, pairs, {"old_values": values, "returns": returns}, plan, value_loss,
                                 tokenizer.pad_token_id, 1.0)
    for key, value in summarise_updates(critic_updates).items():
        if key != "loss":  # the same number as ValueLoss' vf_loss
            out[key if key.startswith(CRITIC_PREFIX) else CRITIC_PREFIX + key] = value
    if train_actor:
        updates = run_updates(policy, pairs, token_fields, plan, actor_loss, tokenizer.pad_token_id, g.temperature)
        out.update(summarise_updates(updates))
    return out


def _value_metrics(values, returns, masks, over_ranks) -> dict:
    """The rollout's critic diagnostics, before its updates: explained variance of the
    returns by the values, and the mean return and value over the response tokens (all ranks)."""
    sums = [sum(float((r * m).sum()) for r, m in zip(returns, masks)),
            sum(float((v * m).sum()) for v, m in zip(values, masks)),
            sum(float(m.sum()) for m in masks)]
    returns_sum, values_sum, count = over_ranks(sums)
    count = max(count, 1.0)
    return {"vf_explained_var": explained_variance(values, returns, masks, over_ranks),
            "returns_mean": returns_sum / count, "values_mean": values_sum / count}
