"""One GRPO step: sample a group of completions per prompt, score them, normalise the
rewards within each group, and take a clipped policy-gradient step with a KL penalty
towards the reference (the SFT-end weights)."""
from __future__ import annotations

import time

import torch

from polyfsdp.backends.distributed import all_reduce_sum

from .batch import build_batch
from .generate import rollout
from .rewards import mean_over_ranks
from .task import Example


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's
    (unbiased) std when ``norm_by_std``. Groups are consecutive runs of ``group_size``."""
    if rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} values is not a multiple of group_size={group_size}")
    groups = rewards.view(-1, group_size).double()
    centred = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.view(-1).float()


def grpo_step(policy, ref, tokenizer, examples: list[Example], cfg, loss_fn, sample_seed: int,
              scorer=None, unshard="auto") -> dict:
    """Train one GRPO step on this rank's prompts ``examples``; ``cfg`` is the GRPOSection.
    ``sample_seed`` seeds the sampling so a resumed run draws the same completions;
    ``unshard`` is ``rollout.unshard`` (trainer/generate.py)."""
    t0 = time.perf_counter()
    policy.backend.manual_seed(sample_seed)
    roll = rollout(policy, tokenizer, examples, cfg.group_size, cfg.max_new_tokens, do_sample=True,
                   temperature=cfg.temperature, scorer=scorer, unshard=unshard)
    t_gen = time.perf_counter() - t0
    rewards = torch.tensor(roll.rewards, dtype=torch.float32)
    adv = group_advantages(rewards, cfg.group_size, cfg.norm_adv_by_std)
    pairs = list(zip(roll.prompt_ids, roll.response_ids))
    lengths = [len(p) + len(r) for p, r in pairs]
    pad_mode = policy.engine_config.pad_mode
    batch = build_batch(pairs, pad_mode, tokenizer.pad_token_id,
                        token_fields={"advantages": [torch.full((n,), float(a)) for n, a in zip(lengths, adv)]})
    batch["old_log_probs"] = policy.infer_batch(batch, temperature=cfg.temperature,
                                                calculate_entropy=False)["log_probs"]
    if ref is not None:
        batch["ref_log_probs"] = ref.infer_batch(batch, temperature=cfg.temperature,
                                                 calculate_entropy=False)["log_probs"]
    metrics = policy.train_batch(batch, loss_fn, temperature=cfg.temperature)
    tokens = float(sum(lengths))
    resp_len = float(sum(len(r) for r in roll.response_ids))
    solved = float(sum(r == 1.0 for r in roll.rewards))
    reward_sum, reward_sq, count, resp_sum, solved_sum = all_reduce_sum(
        [float(rewards.sum()), float((rewards ** 2).sum()), float(rewards.numel()), resp_len, solved], policy.device)
    mean = reward_sum / count
    metrics.update({
        "reward": mean,
        "reward_std": max(reward_sq / count - mean ** 2, 0.0) ** 0.5,
        "solved": solved_sum / count,
        "response_len": resp_sum / count,
        "tokens": tokens,
        "gen_time_s": t_gen,
        "step_time_s": time.perf_counter() - t0,
    })
    metrics.update(mean_over_ranks(roll.reward_metrics))
    return metrics
