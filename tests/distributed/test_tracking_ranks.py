"""Trackers, validation rows and sampled evaluation under ``torchrun --nproc_per_node 2``:
only rank 0 logs, the ranks' samples are gathered in prompt order, and ``polyfsdp-eval`` on 2
ranks scores what it scores on 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchrun_launcher import free_port

from polyfsdp.trainer.evaluation.generations_log import read_generations
from polyfsdp.trainer.tracking.metrics import read_metrics

OVERRIDES = [
    "trainer.sft_steps=4", "trainer.rl_steps=1", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
    "algo.actor.group_size=4", "data.eval_size=9", "trainer.progress=lines", "trainer.plot=false",
    "trainer.checkpoint_interval=0", "trainer.log_val_generations=3", "eval.n_samples=2", "eval.temperature=1.0",
]


def _command(nproc: int, module: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), "-m", module]


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def test_two_ranks_log_once_gather_samples_and_evaluate_like_one(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    _run([*_command(2, "polyfsdp.trainer.train"), *OVERRIDES, "trainer.logger=[console,jsonl,tensorboard]",
          f"trainer.output_dir={out}"], tmp_path)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 1 wrote none
    evals = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"]
    assert [r["tag"] for r in evals] == ["initial", "after_sft", "final"]
    assert all({"mean@2", "pass@1", "pass@2", "maj@2"} <= set(r) and r["mean@2"] == r["reward"] for r in evals)
    rows = read_generations(str(out / "generations.jsonl"))
    assert [r["global_step"] for r in rows] == [0] * 3 + [4] * 3 + [5] * 3  # once, from rank 0

    reports = {}
    for nproc in (1, 2):
        json_path = tmp_path / f"eval{nproc}.json"
        _run([*_command(nproc, "polyfsdp.trainer.eval_cli"), str(out / "final"), "eval.n_samples=1",
              "eval.temperature=0", f"--json={json_path}"], tmp_path)
        reports[nproc] = json.loads(json_path.read_text())
    # Greedy: rank shares (5 + 4 of 9 prompts) gathered back in prompt order.
    assert reports[2]["metrics"]["reward"] == pytest.approx(reports[1]["metrics"]["reward"])
    assert reports[2]["generations"] == reports[1]["generations"] and len(reports[1]["generations"]) == 3
    assert [g["prompt"] for g in reports[1]["generations"]] == [r["prompt"] for r in rows[:3]]
