"""PPO's updates on one rollout give the same weights and metrics on 2 ranks (each holding
half the groups; GAE whitening and losses use all-rank statistics) as on 1 rank."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from torchrun_launcher import run_torchrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "worker_ppo_update.py")


@pytest.mark.parametrize("pad_mode", ["left_right"])  # no_padding: the default job and tests/cpu
def test_ppo_updates_on_two_ranks_equal_one_rank(tmp_path, pad_mode):
    for nproc in (1, 2):
        proc = run_torchrun(WORKER, nproc=nproc, args=(str(tmp_path), pad_mode), timeout=400)
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    m1, m2 = one["metrics"], two["metrics"]
    assert m1["updates"] == m2["updates"] == 2 and m1["vf_updates"] == 2
    for key in ("vf_loss", "vf_clip_frac", "vf_explained_var", "returns_mean", "vf_grad_norm", "pg_loss", "grad_norm",
                "ratio_mean", "loss"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    # The run trained something: the critic clipped some tokens and both models moved.
    assert m1["vf_grad_norm"] > 0 and m1["grad_norm"] > 0
    for model in ("policy", "critic"):
        for name, value in one[model].items():
            assert (two[model][name] - value).abs().max() <= 1e-5, (model, name)
