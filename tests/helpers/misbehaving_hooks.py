"""User code that misbehaves, one hook at a time (tests/cpu/trainer/test_user_hooks_one_line.py runs each
through polyfsdp-train): reward functions, environments, estimators and policy losses."""
import sys

import torch

from polyfsdp.engines.losses import PPOLoss
from polyfsdp.trainer.algos.estimators import Advantages, estimator
from polyfsdp.trainer.algos.policy_losses import PolicyLoss


# ---- reward.fn
def reward_raises(data_source, solution_str, ground_truth, extra_info=None):
    return {}["missing"]


def reward_inf(data_source, solution_str, ground_truth, extra_info=None):
    return float("inf")


def reward_text(data_source, solution_str, ground_truth, extra_info=None):
    return "good"


def reward_exits(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(3)


# ---- rollout.env
class _Env:
    tools = []

    def reset(self, example):
        return [{"role": "user", "content": "go"}]


class HugeRewardEnv(_Env):
    """1e308 is finite; two of them (or their group variance) are not."""

    def step(self, assistant_text):
        return [{"role": "user", "content": "again"}], 1e308, False


class NanRewardEnv(_Env):
    def step(self, assistant_text):
        return [], float("nan"), True


class StepRaisesEnv(_Env):
    def step(self, assistant_text):
        raise RuntimeError("the simulator crashed")


class ResetReturnsNoneEnv(StepRaisesEnv):
    def reset(self, example):
        return None


# ---- algo.adv_estimator
def _filled(inputs, value_at_one):
    adv = [torch.zeros(len(m)) for m in inputs.masks]
    adv[min(1, len(adv) - 1)][0] = value_at_one
    return Advantages(adv)


@estimator("nan_advantages", "an estimator that divides by a zero std")
def nan_advantages(inputs):
    return _filled(inputs, float("nan"))


@estimator("inf_advantages", "an estimator that overflows")
def inf_advantages(inputs):
    return _filled(inputs, float("inf"))


@estimator("estimator_raises", "an estimator with a bug")
def estimator_raises(inputs):
    return [][0]


# ---- algo.actor.policy_loss
class StringMetricLoss(PPOLoss):
    """A metric holding a string on every batch: caught on the made-up batch, before the job."""

    def __call__(self, inputs):
        loss, metrics = super().__call__(inputs)
        return loss, {**metrics, "note": "clipped a lot"}


class LateStringMetricLoss(PPOLoss):
    """A string metric only on batches larger than the made-up one: caught in the run."""

    def __call__(self, inputs):
        loss, metrics = super().__call__(inputs)
        if inputs.offsets.numel() - 1 > 2:
            metrics = {**metrics, "note": "clipped a lot"}
        return loss, metrics


class LossRaises(PPOLoss):
    def __call__(self, inputs):
        raise ZeroDivisionError("division by zero")


string_metric = PolicyLoss("string_metric", StringMetricLoss, "a metric holding a string", 0.2, 0.28)
late_string_metric = PolicyLoss("late_string_metric", LateStringMetricLoss, "a string metric in the run", 0.2, 0.28)
loss_raises = PolicyLoss("loss_raises", LossRaises, "a loss that raises", 0.2, 0.28)
