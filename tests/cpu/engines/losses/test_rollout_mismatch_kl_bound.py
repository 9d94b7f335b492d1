"""rollout_mismatch_kl is bounded (issue 38, item 4): one token whose sampler log-prob is far from
the trainer's must not swamp the logged mean. The bound is verl's: the log-ratio clamped to
[-20, 20] (verl's SAFETY_BOUND in rollout_corr_helper, the bound of core_algos' low_var_kl), the
per-token k3 estimate to [-10, 10] (low_var_kl's); the unbounded size of the worst token stays
visible as rollout_mismatch_abs_max (a log-ratio, finite whatever the gap)."""
import math

import pytest

from tests.helpers.loss_cases import loss_inputs_from_sequences
from polyfsdp.engines.losses import PPOLoss


def _bounded_k3_float64(log_ratio: float) -> float:
    x = min(max(log_ratio, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def test_a_log_ratio_of_25_reads_the_bounded_k3_not_exp_25():
    # Token 1: train - rollout = 25 (exp(25) - 26 = 7.2e10 unbounded); token 2: 0.5.
    old = [[-1.0, -0.5, -2.0, 0.0]]
    rollout = [[-1.0, -25.5, -2.5, 0.0]]
    fields = {"response_mask": [[0.0, 1.0, 1.0, 0.0]], "old_log_probs": old, "advantages": [[0.0, 1.0, -1.0, 0.0]],
              "rollout_log_probs": rollout}
    _, metrics = PPOLoss(report_mismatch=True)(loss_inputs_from_sequences(old, fields))
    expected = (_bounded_k3_float64(25.0) + _bounded_k3_float64(0.5)) / 2
    assert float(metrics["rollout_mismatch_kl"]) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["rollout_mismatch_kl"]) < 10.0
    assert float(metrics["rollout_mismatch_abs_max"]) == pytest.approx(25.0)
