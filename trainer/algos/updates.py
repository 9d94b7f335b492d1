"""Update-many: one rollout feeds ``epochs x mini-batches`` optimizer steps.

Mini-batches hold whole groups, shuffled per epoch by a generator seeded from the step
alone (the same on every rank, so a resumed run reshuffles identically). Every rank holds
the same number of groups, so every rank takes the same number of optimizer steps and
FSDP's collectives pair up; each step normalises over its own mini-batch (global counts).
"""
from __future__ import annotations

import torch

from ..data.batch import build_batch, per_sequence


def mini_batch_plan(num_groups: int, group_size: int, mini_batches: int, epochs: int,
                    seed: int) -> list[list[int]]:
    """Sequence indices of each optimizer step, in order: ``epochs`` passes, each a seeded
    permutation of the groups cut into ``mini_batches`` near-equal parts (one mini-batch:
    the rollout in its own order)."""
    mini_batches = max(1, min(mini_batches, num_groups))
    generator = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(epochs):
        order = torch.randperm(num_groups, generator=generator).tolist() if mini_batches > 1 \
            else list(range(num_groups))
        for part in torch.tensor(order, dtype=torch.long).tensor_split(mini_batches):
            plan.append([g * group_size + j for g in part.tolist() for j in range(group_size)])
    return plan


def run_updates(policy, pairs: list, token_fields: dict[str, list[torch.Tensor]], plan: list[list[int]],
                loss_fn, pad_token_id: int, temperature: float, images: list | None = None) -> list[dict]:
    """One optimizer step (and scheduler step) per entry of ``plan``; their metrics. ``images``:
    per row, the Example whose prompt holds images, or None (trainer/data/batch.py)."""
    pad_mode = policy.engine_config.pad_mode
    results = []
    for indices in plan:
        batch = build_batch([pairs[i] for i in indices], pad_mode, pad_token_id,
                            token_fields={k: [v[i] for i in indices] for k, v in token_fields.items()},
                            images=None if images is None else [images[i] for i in indices])
        results.append(policy.train_batch(batch, loss_fn, temperature=temperature))
    return results


def summarise_updates(updates: list[dict]) -> dict:
    """A rollout's metrics from its optimizer steps': the mean, the max for ``*_max`` keys,
    the count for ``step_skipped``; ``updates`` is how many steps the rollout fed."""
    keys = sorted(set().union(*updates))
    out = {}
    for key in keys:
        values = [u[key] for u in updates if key in u]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key == "step_skipped":
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    out["updates"] = len(updates)
    return out


def old_and_ref_log_probs(policy, ref, batch, temperature: float, need_old: bool,
                          token_fields: dict[str, list[torch.Tensor]]):
    """Per-sequence log-probs of the rollout ``batch`` under the sampling policy (only when
    ``need_old``: with one update per rollout the ratio is 1 without them) and under the
    frozen reference (when there is one); stored in ``token_fields`` as ``old_log_probs`` /
    ``ref_log_probs`` and returned as ``(old, ref)``, None where not computed. Both are
    computed on the response positions alone and read 0 elsewhere: the losses, estimators and
    metrics read them under the response mask only (the LM head runs there, engines/head/rows.py)."""
    pad_mode = policy.engine_config.pad_mode
    out = {}
    for name, engine in (("old_log_probs", policy if need_old else None), ("ref_log_probs", ref)):
        if engine is not None:
            out[name] = per_sequence(engine.infer_batch(batch, temperature=temperature, calculate_entropy=False,
                                                        mask_field="response_mask")["log_probs"], batch, pad_mode)
    token_fields.update(out)
    return out.get("old_log_probs"), out.get("ref_log_probs")
