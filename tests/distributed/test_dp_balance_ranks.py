"""Token-balanced data-parallel batches (gloo): with ``balance_dp_tokens`` every rank gets
back its own sequences' log-probs/entropy in its own order, the loss and the gradients equal
the unbalanced run's, and the imbalance metric drops on a skewed batch. 2 ranks in the suite;
2 sequence-parallel groups of 2 (4 processes) marked extended."""
import os
import sys

import pytest

from torchrun_launcher import run_and_load

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from worker_dp_balance import SKEWED  # noqa: E402

PAD_MODES = ("no_padding", "left_right")


def _launch(tmp_path_factory, nproc, sp_size):
    return run_and_load(os.path.join(HERE, "worker_dp_balance.py"), tmp_path_factory.mktemp(f"balance_world{nproc}"),
                        nproc, (str(sp_size),), "balance.pt")


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, 1)


def check_order_restored(ranks, pad_mode):
    for rank, results in enumerate(ranks):
        plain, balanced = results[f"infer_{pad_mode}_plain"], results[f"infer_{pad_mode}_balanced"]
        for key in ("log_probs", "entropy"):
            assert balanced[key].shape == plain[key].shape
            assert (balanced[key] - plain[key]).abs().max().item() <= 1e-5, (rank, key)
    # The replicas' batches differ (so a mix-up between them would show).
    assert ranks[0][f"infer_{pad_mode}_plain"]["log_probs"].shape != ranks[-1][f"infer_{pad_mode}_plain"][
        "log_probs"].shape


def check_training_equal(ranks, pad_mode):
    for rank, results in enumerate(ranks):
        plain, balanced = results[f"metrics_{pad_mode}_plain"], results[f"metrics_{pad_mode}_balanced"]
        assert abs(balanced["loss"] - plain["loss"]) <= 1e-6 * abs(plain["loss"])
        assert abs(balanced["grad_norm"] - plain["grad_norm"]) <= 1e-5 * plain["grad_norm"]
        for name, grad in results[f"grads_{pad_mode}_plain"].items():
            assert (results[f"grads_{pad_mode}_balanced"][name] - grad).abs().max().item() <= 1e-5, (rank, name)


def check_imbalance_metric(ranks):
    tokens = [sum(SKEWED[0]), sum(SKEWED[1])]
    before = max(tokens) / (sum(tokens) / 2)
    for results in ranks:
        metrics = results["metrics_no_padding_balanced"]
        assert metrics["dp_token_imbalance_before_max"] == pytest.approx(before)
        # Longest first onto the lighter replica: 12+7+3+1 = 23 vs 11+9+2 = 22 tokens.
        assert metrics["dp_token_imbalance_after_max"] == pytest.approx(23 / 22.5)
        assert "dp_token_imbalance_before_max" not in results["metrics_no_padding_plain"]


@pytest.mark.parametrize("pad_mode", PAD_MODES)
def test_balanced_outputs_come_back_in_each_ranks_own_order(world2, pad_mode):
    check_order_restored(world2, pad_mode)


@pytest.mark.parametrize("pad_mode", PAD_MODES)
def test_balanced_training_equals_the_unbalanced_step(world2, pad_mode):
    check_training_equal(world2, pad_mode)


def test_imbalance_metric_drops_on_a_skewed_batch(world2):
    check_imbalance_metric(world2)


@pytest.mark.extended
def test_balance_over_two_sequence_parallel_groups_of_two(tmp_path_factory):
    ranks = _launch(tmp_path_factory, 4, 2)
    for pad_mode in PAD_MODES:
        check_order_restored(ranks, pad_mode)
        check_training_equal(ranks, pad_mode)
    check_imbalance_metric(ranks)
