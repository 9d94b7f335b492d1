"""A vision-language model (tiny Qwen2-VL) on 2 ranks (gloo): the vision tower and the decoder
sharded by FSDP2, ranks with different images (one with text-only micro-batches), every
configuration's log-probs and entropy equal HF's per-sequence forward, and the gradients,
summed over ranks, equal the reference's over both ranks' sequences (worker_vlm.py)."""
import os

import pytest
import torch

from torchrun_launcher import run_and_load

HERE = os.path.dirname(__file__)
RUNS = ("plain", "budget", "balanced", "padded")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(os.path.join(HERE, "worker_vlm.py"), tmp_path_factory.mktemp("vlm_world2"), 2, (), "vlm.pt")


@pytest.mark.parametrize("run", RUNS)
def test_every_rank_matches_the_per_sequence_reference(ranks, run):
    for rank, results in enumerate(ranks):
        for key, expected in zip(("log_probs", "entropy"), results["expected"]):
            diff = (results[f"infer_{run}"][key].double() - torch.cat(expected)).abs().max().item()
            assert diff <= 1e-5, (rank, run, key, diff)


@pytest.mark.parametrize("run", RUNS)
def test_gradients_summed_over_ranks_equal_the_reference(ranks, run):
    expected = ranks[0]["expected_grads"]
    scale = max(g.abs().max().item() for g in expected.values())
    for rank, results in enumerate(ranks):
        grads = results[f"grads_{run}"]
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            diff = (grad.double() - expected[name].double()).abs().max().item()
            assert diff <= 1e-5 * scale, (rank, run, name, diff, scale)


@pytest.mark.parametrize("run", RUNS)
def test_sft_step_gradients_equal_the_reference(ranks, run):
    """forward_backward with SFTLoss (token-mean over both ranks' response tokens): the
    gradients are the reference's masked log-prob sum's, times -1 / tokens."""
    tokens = ranks[0]["response_tokens"]
    expected = {n: -g / tokens for n, g in ranks[0]["expected_grads"].items()}
    scale = max(g.abs().max().item() for g in expected.values())
    for rank, results in enumerate(ranks):
        for name, grad in results[f"sft_grads_{run}"].items():
            diff = (grad.double() - expected[name].double()).abs().max().item()
            assert diff <= 1e-5 * scale, (rank, run, name, diff, scale)
