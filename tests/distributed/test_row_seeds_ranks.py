"""Sampling seeds per global sample (trainer/rollout/row_seeds.py): one RL step's completions for the
same global prompts are the same token ids on one rank and on two data-parallel replicas (gloo),
with the default rollout engine (the decoding loop on the gathered model) and with HF
``generate`` (per-layer gathers, ranks in lockstep); one generator per replica, the seeding
polyfsdp had before, does not keep them (the negative control)."""
import os
import subprocess
import sys

import torch

from torchrun_launcher import run_torchrun

WORKER = os.path.join(os.path.dirname(__file__), "worker_row_seeds.py")


def _completions(out, world):
    if world == 1:  # a plain process: one rank without torchrun
        env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
        result = subprocess.run([sys.executable, WORKER, str(out)], capture_output=True, text=True, timeout=300,
                                env=env)
    else:
        result = run_torchrun(WORKER, nproc=world, args=(str(out),))
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / f"completions_world{world}.pt")


def test_a_step_draws_the_same_completions_on_one_and_two_replicas(tmp_path):
    one, two = _completions(tmp_path, 1), _completions(tmp_path, 2)
    for engine in ("default", "hf"):
        assert len(one[engine]) == 8 * 4 and len(set(map(tuple, one[engine]))) > 8, engine  # sampled, not greedy
        assert two[engine] == one[engine], engine
    assert two["per_replica"] != one["per_replica"]
