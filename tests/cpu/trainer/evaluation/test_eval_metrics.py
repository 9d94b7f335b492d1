"""pass@k against brute-force enumeration of every k-subset; maj@n and mean@n against hand-computed values."""
from __future__ import annotations

import itertools

import pytest

from polyfsdp.trainer.evaluation.metrics import (PromptSamples, evaluation_metrics, k_values, majority_reward,
                                           pass_at_k)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_the_fraction_of_k_subsets_holding_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_by_hand_and_refusals():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)       # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 150, 100) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]


def test_majority_vote_takes_the_most_frequent_answer_first_seen_on_ties():
    assert majority_reward([0.0, 1.0, 1.0, 0.0], ["7", "8", "8", None]) == 1.0
    assert majority_reward([0.0, 1.0], ["7", "8"]) == 0.0          # tie: "7" came first
    assert majority_reward([0.5, 0.5], [None, None]) == 0.0         # no answer to vote for


def test_evaluation_metrics_overall_and_per_data_source():
    prompts = [PromptSamples(0, "gsm8k", [1.0, 0.0, 0.0, 1.0], ["4", "5", "5", "4"]),
               PromptSamples(1, "gsm8k", [0.0, 0.0, 0.0, 0.0], ["1", "2", "3", "3"]),
               PromptSamples(2, "math", [0.0, 1.0, 1.0, 1.0], ["x", "y", "y", "y"])]
    got = evaluation_metrics(prompts)
    # pass@1 = c/n per prompt: (2/4 + 0 + 3/4) / 3; pass@2: 1 - C(n-c,2)/C(4,2) = 5/6, 0, 1.
    assert got["reward"] == pytest.approx(5 / 12) and got["mean@4"] == got["reward"]
    assert got["pass@1"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert got["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert got["pass@4"] == pytest.approx(2 / 3)
    # Majority: prompt 0 ties "4"/"5" -> "4" (reward 1), prompt 1 "3" (0), prompt 2 "y" (1).
    assert got["maj@4"] == pytest.approx(2 / 3)
    assert got["gsm8k/pass@4"] == pytest.approx(0.5) and got["math/maj@4"] == 1.0
    assert got["math/reward"] == pytest.approx(0.75)


def test_one_sample_per_prompt_reports_only_the_reward_and_threshold_counts():
    assert evaluation_metrics([PromptSamples(0, "", [0.25], [None])]) == {"reward": 0.25}
    partial = [PromptSamples(0, "", [0.5, 0.9], [None, None])]
    assert "maj@2" not in evaluation_metrics(partial)
    assert evaluation_metrics(partial, pass_threshold=0.8)["pass@1"] == pytest.approx(0.5)
    assert evaluation_metrics(partial)["pass@2"] == 0.0
