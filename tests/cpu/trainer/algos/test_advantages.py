"""Advantage estimators against hand-computed values; constant groups give 0, never NaN."""
import math

import pytest
import torch

from polyfsdp.trainer.algos.advantages import GROUP_ESTIMATORS, group_advantages, reinforce_plus_plus_advantages

S = 1 / math.sqrt(2)  # (1 - 0.5) / std([1, 0]) with the unbiased std 0.7071

CASES = [
    # estimator, rewards, group size, norm_by_std, expected (per completion)
    ("grpo", [1.0, 0.0, 0.5, 0.5], 2, True, [S, -S, 0.0, 0.0]),
    ("grpo", [1.0, 0.0, 1.0, 0.2, 0.2, 0.2], 3, False, [1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.0]),
    ("dr_grpo", [1.0, 0.0, 1.0, 0.2, 0.2, 0.2], 3, True, [1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.0]),
    # leave-one-out: r_i - mean of the other two
    ("rloo", [1.0, 0.0, 1.0, 0.3, 0.6, 0.0], 3, True, [0.5, -1.0, 0.5, 0.0, 0.45, -0.45]),
    ("rloo", [0.7, 0.7], 2, True, [0.0, 0.0]),
]


@pytest.mark.parametrize("estimator,rewards,group_size,norm_by_std,expected", CASES)
def test_group_estimators_match_hand_values(estimator, rewards, group_size, norm_by_std, expected):
    adv = group_advantages(torch.tensor(rewards), group_size, estimator, norm_by_std)
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_reinforce_plus_plus_whitens_reward_to_go_with_kl_in_the_reward():
    # Two sequences; response positions 1..2 and 1..3. Per-token reward = -0.5 * kl, plus the
    # score at the last response token; returns = reward-to-go.
    masks = [torch.tensor([0.0, 1, 1, 0]), torch.tensor([0.0, 1, 1, 1, 0])]
    kl = [torch.tensor([9.0, 0.2, 0.4, 9.0]), torch.tensor([9.0, 0.0, 0.2, -0.2, 9.0])]
    returns = [[1 - 0.1 - 0.2, 1 - 0.2], [0 - 0.0 - 0.1 + 0.1, -0.1 + 0.1, 0.1]]
    flat = [x for r in returns for x in r]
    mean = sum(flat) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / 4 + 1e-8)
    adv = reinforce_plus_plus_advantages([1.0, 0.0], masks, kl, 0.5)
    assert adv[0].tolist() == pytest.approx([0.0] + [(x - mean) / std for x in returns[0]] + [0.0], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([0.0] + [(x - mean) / std for x in returns[1]] + [0.0], abs=1e-5)


def test_reinforce_plus_plus_uses_moments_summed_over_ranks():
    # A second rank holding the same data doubles every moment: the mean is the same, the
    # unbiased variance changes with the count (2n - 1 instead of n - 1).
    masks, rewards = [torch.tensor([0.0, 1, 1, 0])], [1.0]
    one = reinforce_plus_plus_advantages(rewards, masks, None, 0.0)
    two = reinforce_plus_plus_advantages(rewards, masks, None, 0.0, sum_over_ranks=lambda v: [2 * x for x in v])
    # returns [1, 1]: constant, so zero either way; with a spread they differ.
    assert one[0].tolist() == two[0].tolist() == [0.0] * 4
    kl = [torch.tensor([0.0, 1.0, 0.0, 0.0])]
    one = reinforce_plus_plus_advantages(rewards, masks, kl, 1.0)
    two = reinforce_plus_plus_advantages(rewards, masks, kl, 1.0, sum_over_ranks=lambda v: [2 * x for x in v])
    # returns [0, 1]: mean 0.5; unbiased variance 0.5 on one rank, (2 - 4 * 0.25) / 3 on two.
    assert one[0][1].item() == pytest.approx(-0.5 / math.sqrt(0.5), abs=1e-5)
    assert two[0][1].item() == pytest.approx(-0.5 / math.sqrt(1 / 3), abs=1e-5)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS + ("reinforce_plus_plus",))
def test_constant_rewards_give_zero_advantage_not_nan(estimator):
    rewards = torch.full((8,), 0.25)
    if estimator == "reinforce_plus_plus":
        masks = [torch.tensor([0.0, 1, 1, 0])] * 8
        adv = torch.cat(reinforce_plus_plus_advantages(rewards.tolist(), masks, None, 0.0))
    else:
        adv = group_advantages(rewards, 4, estimator)
    assert torch.isfinite(adv).all() and adv.abs().max().item() < 1e-6


def test_group_estimators_reject_a_partial_group_and_an_unknown_name():
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group estimators"):
        group_advantages(torch.zeros(4), 2, "reinforce_plus_plus")
