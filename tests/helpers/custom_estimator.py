"""A user's own advantage estimator, outside polyfsdp: ``algo.adv_estimator=PATH/custom_estimator.py:
median_baseline`` (tests/cpu/trainer/algos/test_estimator_registry.py runs it through polyfsdp-train)."""
import torch

from polyfsdp.trainer.algos.estimators import Advantages, estimator

CALLS: list[dict] = []  # what each call saw, for the test


@estimator("median_baseline", "r - the group's median reward")
def median_baseline(inputs):
    rewards = torch.tensor(inputs.rewards, dtype=torch.float32).reshape(-1, inputs.group_size)
    adv = (rewards - rewards.median(dim=1, keepdim=True).values).reshape(-1)
    CALLS.append({"rewards": list(inputs.rewards), "advantages": adv.tolist(), "group_size": inputs.group_size,
                  "values": inputs.values, "kl": inputs.kl})
    return Advantages([torch.full((len(m),), float(a)) for m, a in zip(inputs.masks, adv)])


def not_an_estimator(inputs):
    return None


@estimator("last_turn_only", "an estimator that cannot skip environment turns", multi_turn=False)
def last_turn_only(inputs):
    return median_baseline(inputs)


@estimator("raises", "an estimator with a bug")
def raises(inputs):
    return {}["missing"]


@estimator("exits", "an estimator that ends the process")
def exits(inputs):
    raise SystemExit(0)


@estimator("returns_a_list", "an estimator that forgets the Advantages wrapper")
def returns_a_list(inputs):
    return [torch.zeros(len(m)) for m in inputs.masks]


@estimator("one_short", "an estimator that drops a sequence")
def one_short(inputs):
    return Advantages([torch.zeros(len(m)) for m in inputs.masks][1:])
