"""The per-token reverse KL of on-policy distillation and the advantage it adds.

On the student's own sampled tokens ``x_t``, ``log pi_student(x_t) - log pi_teacher(x_t)`` is a
one-sample estimate of KL(student || teacher) at position ``t`` (its expectation over the
student's draws is the KL). As in Tinker's cookbook and verl, it is a per-token negative reward
with no discounting: each response token's advantage is ``task_weight * A_task - coef * kl_t``,
so the policy-gradient loss carries it and no gradient flows through the estimate itself
(the student's log-probs are the step's old ones, computed before the update).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...data.batch import per_sequence

# The step record's keys: the mean per-token estimate over the response tokens of every
# replica, and the share of the mixed advantage's magnitude that the KL term makes.
REVERSE_KL_KEY = "distill/reverse_kl"
ADVANTAGE_SHARE_KEY = "distill/adv_share"


def teacher_log_probs(teacher, batch, temperature: float, pad_mode: str) -> list[torch.Tensor]:
    """The teacher's per-token log-probs of the rollout ``batch``, one flat tensor per sequence:
    the reference's log-prob pass (engine ``infer_batch``: every pad mode, SP, micro-batches) at
    the sampling temperature, as the student's, so the KL is zero exactly when the student's
    model is the teacher's. Computed on the response positions alone (0 elsewhere): the KL reads no other."""
    return per_sequence(teacher.infer_batch(batch, temperature=temperature, calculate_entropy=False,
                                            mask_field="response_mask")["log_probs"], batch, pad_mode)


def reverse_kl_per_token(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor],
                         masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``log pi_student - log pi_teacher`` on each response token (float64), 0 elsewhere."""
    # where, not a product: a prompt position's value (anything) must not reach the estimate.
    return [torch.where(m.bool(), s.double() - t.double(), 0.0) for s, t, m in zip(student, teacher, masks)]


def distill_advantages(task_advantages: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
                       student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor], coef: float,
                       task_weight: float, sum_over_ranks: Callable[[list[float]], list[float]]
                       ) -> tuple[list[torch.Tensor], dict]:
    """``task_weight * A_task - coef * kl`` per token (one float32 tensor per sequence, shaped
    like its mask) and the step's distillation metrics over every replica (``sum_over_ranks``
    counts each replica once)."""
    kl = reverse_kl_per_token(student, teacher, masks)
    mixed, kl_sum, kl_abs, task_abs, count = [], 0.0, 0.0, 0.0, 0.0
    for adv, k, m in zip(task_advantages, kl, masks):
        on = m.bool()
        task = task_weight * adv.double()
        mixed.append((task - coef * k).to(adv.dtype))
        kl_sum += float(k.sum())
        kl_abs += float(k.abs().sum())
        task_abs += float(torch.where(on, task, 0.0).abs().sum())
        count += float(on.sum())
    kl_sum, kl_abs, task_abs, count = sum_over_ranks([kl_sum, kl_abs, task_abs, count])
    kl_part = coef * kl_abs
    share = kl_part / (kl_part + task_abs) if kl_part + task_abs > 0 else 0.0
    return mixed, {REVERSE_KL_KEY: kl_sum / max(count, 1.0), ADVANTAGE_SHARE_KEY: share}
