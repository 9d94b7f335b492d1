"""polyfsdp-train under ``torchrun --nproc_per_node 2`` (gloo on CPU) matches one process.

The global batch is the same whatever the world size (each replica takes its share), losses
are normalised by global token counts and rank gradients are summed, so the SFT curve and
the greedy evaluations of a 2-rank run must equal those of a 1-rank run. GRPO seeds each
completion by its global row (trainer/rollout/row_seeds.py), so its rollouts draw the same completions
too: the same response lengths and solved shares, rewards equal to rounding.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from torchrun_launcher import free_port

from tests.helpers import HELPERS
from polyfsdp.trainer.tracking.metrics import TIMING_KEYS, read_metrics

OVERRIDES = [
    "trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
    "algo.actor.group_size=4", "data.eval_size=9", "trainer.progress=lines", "trainer.plot=false",
    "trainer.checkpoint_interval=2",
]


def _launch(out, nproc: int, *extra: str, timeout: int = 400, base=OVERRIDES) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        command = [sys.executable, "-m", "polyfsdp.trainer.train"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "polyfsdp.trainer.train"]
    return subprocess.run([*command, *base, *extra, f"trainer.output_dir={out}"], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_two_rank_run_matches_one_rank_sft_curve_and_evaluations(tmp_path):
    two = _launch(tmp_path / "two", 2)
    assert two.returncode == 0, (two.stdout[-2000:], two.stderr[-3000:])
    one = _launch(tmp_path / "one", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "2 rank(s)" in two.stdout
    r2, r1 = read_metrics(str(tmp_path / "two" / "metrics.jsonl")), read_metrics(str(tmp_path / "one" / "metrics.jsonl"))
    sft2 = [r for r in r2 if r["phase"] == "sft"]
    sft1 = [r for r in r1 if r["phase"] == "sft"]
    assert len(sft2) == len(sft1) == 2
    for a, b in zip(sft2, sft1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    evals2 = {r["tag"]: r["reward"] for r in r2 if r["phase"] == "eval"}
    evals1 = {r["tag"]: r["reward"] for r in r1 if r["phase"] == "eval"}
    # 9 prompts over 2 ranks: uneven shares, still the mean over all 9.
    assert evals2["initial"] == pytest.approx(evals1["initial"]) and evals2["after_sft"] == pytest.approx(evals1["after_sft"])
    assert [r["step"] for r in r2 if r["phase"] == "rl"] == [1, 2]
    _assert_same_rollouts([r for r in r2 if r["phase"] == "rl"], [r for r in r1 if r["phase"] == "rl"])
    assert (tmp_path / "two" / "final" / "config.json").is_file()
    assert (tmp_path / "two" / "checkpoints" / "rl" / "latest").is_file()


def _assert_same_rollouts(got, expected):
    """RL records whose rollouts drew the same completions: response lengths and solved shares
    are exact (counts), the mean reward equal to the rounding of the sum over ranks."""
    assert [r["step"] for r in got] == [r["step"] for r in expected] and got
    for a, b in zip(got, expected):
        assert (a["response_len"], a["solved"]) == (b["response_len"], b["solved"]), a["step"]
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-6, abs=1e-9), a["step"]


RANK_REWARD = """
import os


def score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "rank": float(os.environ["RANK"])}
"""


def test_reward_metrics_are_averaged_over_ranks(tmp_path):
    (tmp_path / "rank_reward.py").write_text(RANK_REWARD)
    two = _launch(tmp_path / "two", 2, f"reward.fn={tmp_path / 'rank_reward.py'}:score", "trainer.sft_steps=0",
                  "trainer.export=false", "trainer.checkpoint_interval=0")
    assert two.returncode == 0, (two.stdout[-2000:], two.stderr[-3000:])
    grpo = [r for r in read_metrics(str(tmp_path / "two" / "metrics.jsonl")) if r["phase"] == "rl"]
    assert [r["reward/rank"] for r in grpo] == [0.5, 0.5]  # ranks 0 and 1, equal shares


UNEVEN_REWARD = """
import os


def score(data_source, solution_str, ground_truth, extra_info=None):
    # Rank 0's groups are all constant (filtered out), rank 1's carry signal: the ranks
    # disagree on how many groups they keep, yet must take the same optimizer steps.
    if os.environ["RANK"] == "0":
        return 0.5
    return float(len(solution_str) % 2)
"""


def test_update_many_with_group_filtering_keeps_ranks_in_step(tmp_path):
    (tmp_path / "uneven.py").write_text(UNEVEN_REWARD)
    two = _launch(tmp_path / "two", 2, "algo.actor.epochs=2", "algo.actor.mini_batch_size=2",
                  "algo.adv_estimator=rloo", "trainer.sft_steps=0", "trainer.export=false",
                  "trainer.checkpoint_interval=0")
    assert two.returncode == 0, (two.stdout[-2000:], two.stderr[-3000:])
    records = read_metrics(str(tmp_path / "two" / "metrics.jsonl"))
    # 4 prompts per step, 2 per optimizer step, 2 epochs: 4 updates per rollout, on both ranks.
    assert [r["updates"] for r in records if r["phase"] == "rl"] == [4, 4]
    assert [(r["step"], r["update"]) for r in records if r["phase"] == "rl_update"] == \
        [(s, u) for s in (1, 2) for u in (1, 2, 3, 4)]
    filtered = _launch(tmp_path / "filtered", 2, "algo.actor.epochs=2", "algo.actor.mini_batch_size=2",
                       "algo.actor.filter_groups=true", "algo.actor.max_sample_batches=2",
                       f"reward.fn={tmp_path / 'uneven.py'}:score", "trainer.sft_steps=0", "trainer.export=false",
                       "trainer.checkpoint_interval=0")
    assert filtered.returncode == 0, (filtered.stdout[-2000:], filtered.stderr[-3000:])
    grpo = [r for r in read_metrics(str(tmp_path / "filtered" / "metrics.jsonl")) if r["phase"] == "rl"]
    # Rank 0 keeps no group, so neither rank trains (the smallest count wins): no hang, a metric.
    assert [(r["filter/groups"], r["filter/short"], r["filter/sample_rounds"]) for r in grpo] == [(0.0, 1.0, 2.0)] * 2


RANK1_BAD_RECORD_REWARD = """
import os


def score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ["RANK"] == "1":  # the records rank 1 scores are bad; rank 0's are fine
        raise ValueError("bad record")
    return 0.5
"""


def test_an_error_on_one_rank_stops_every_rank_promptly_with_one_line(tmp_path):
    (tmp_path / "bad.py").write_text(RANK1_BAD_RECORD_REWARD)
    # Rank 0 used to wait in the evaluation's all-reduce until the 600 s process-group timeout.
    two = _launch(tmp_path / "two", 2, f"reward.fn={tmp_path / 'bad.py'}:score", "trainer.sft_steps=0",
                  timeout=240)
    assert two.returncode != 0
    ours = [line for line in two.stderr.splitlines() if line.startswith("polyfsdp-train")]
    assert len(ours) == 1, two.stderr[-3000:]
    raise_line = RANK1_BAD_RECORD_REWARD.splitlines().index('        raise ValueError("bad record")') + 1
    assert ours[0].startswith(f"polyfsdp-train: error: rank 1: reward.fn={tmp_path / 'bad.py'}:score raised "
                              f"ValueError: bad record at {tmp_path / 'bad.py'}:{raise_line} (record "), ours[0]
    assert "Traceback" not in two.stdout


@pytest.mark.parametrize("at, step, left", [("record", 1, ""), ("rollout", 2, " (left for the resumed run: rl step 2)")])
def test_sigterm_on_one_rank_checkpoints_every_rank_and_resume_completes(tmp_path, at, step, left):
    # "rollout": the signal lands in rank 1's sampling of step 2; both ranks abandon that step at
    # the same cancellation point (an all-reduce each) and save step 1's boundary.
    child = os.path.join(HELPERS, "cli_sigterm_child.py")
    out = tmp_path / "two"
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1", "SIGTERM_RANK": "1", "SIGTERM_AT": at}
    steps = ["trainer.sft_steps=0", "trainer.export=false", "trainer.checkpoint_interval=0"]
    preempted = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), child, "rl", str(step),
                                *OVERRIDES, *steps, f"trainer.output_dir={out}"],
                               capture_output=True, text=True, timeout=240, env=env)
    checkpoint = out / "checkpoints" / "rl" / "step_000001"
    ours = [line for line in preempted.stderr.splitlines() if line.startswith("polyfsdp-train")]
    # Only rank 1 got the signal; both ranks saved at the same boundary and stopped (no hang).
    assert ours == [f"polyfsdp-train: stopped by SIGTERM after rl step 1{left}; checkpoint saved: {checkpoint}; "
                    f"continue with: torchrun --nproc_per_node=2 -m polyfsdp.trainer.train "
                    f"{shlex.join([*OVERRIDES, *steps])} trainer.output_dir={out} trainer.resume=auto"], \
        preempted.stderr[-3000:]
    assert {p.name for p in checkpoint.iterdir()} >= {"rng_rank0.pt", "rng_rank1.pt", "manifest.json"}
    resumed = _launch(out, 2, *steps, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming rl from {checkpoint}" in resumed.stdout
    grpo = [r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl"]
    assert grpo == [1, 2]


def test_an_async_run_on_two_ranks_resumes_each_ranks_queue_exactly(tmp_path):
    # rollout.max_staleness=1: the checkpoint after rl step 2 holds step 3's batch, a different
    # share on each rank (gathered to rank 0's trainer state, handed back per rank on resume).
    child = os.path.join(HELPERS, "cli_sigterm_child.py")
    steps = ["trainer.sft_steps=0", "trainer.export=false", "trainer.checkpoint_interval=0", "trainer.rl_steps=3",
             "rollout.max_staleness=1"]
    reference = _launch(tmp_path / "reference", 2, *steps)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "two"
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1", "SIGTERM_RANK": "1"}
    preempted = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), child, "rl", "2",
                                *OVERRIDES, *steps, f"trainer.output_dir={out}"],
                               capture_output=True, text=True, timeout=240, env=env)
    assert preempted.returncode != 0 and "stopped by SIGTERM after rl step 2" in preempted.stderr, \
        preempted.stderr[-3000:]
    resumed = _launch(out, 2, *steps, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    comparable = lambda run: [{k: v for k, v in r.items() if k not in TIMING_KEYS}  # noqa: E731
                              for r in read_metrics(str(run / "metrics.jsonl"))]
    records = comparable(tmp_path / "reference")
    assert [r["async/staleness"] for r in records if r["phase"] == "rl"] == [0.0, 1.0, 1.0]
    assert comparable(out) == records
