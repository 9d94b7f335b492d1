"""A SIGTERM stops a run sooner than the end of its step: a step that has not applied an
update yet is abandoned at its next cancellation point (engines/cancellation.py), an evaluation
is never run on the way out, and the checkpoint of the last step boundary (saved first) is what
``trainer.resume=auto`` continues from, to the same records and weights as an uninterrupted run."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from tests.helpers import HELPERS
from tests.cpu.trainer.test_cli import TINY, TINY_GRPO, _cli, _comparable, _run

from polyfsdp.engines.cancellation import cancellable, cancellation_point
from polyfsdp.engines.checkpoint.files import load_plain
from polyfsdp.trainer.evaluation.generations_log import read_generations
from polyfsdp.trainer.run.stop import StepAbandoned, StepGuard, StopRequest
from polyfsdp.trainer.tracking.metrics import read_metrics

# An evaluation after RL step 2; checkpoints (trainer.checkpoint_interval) never change the records
# or the weights, so one uninterrupted run is every test's reference.
RUN = ["trainer.sft_steps=2", "trainer.rl_steps=4", "trainer.plot=false", "trainer.log_val_generations=2",
       "trainer.eval_interval=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("reference"), "full", *RUN, "trainer.checkpoint_interval=0")


def _terminated(out, at: str, phase: str, step: int, *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(HELPERS, "cli_sigterm_child.py"), phase, str(step), *TINY,
                           *TINY_GRPO, *RUN, *overrides, f"trainer.output_dir={out}"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "POLYFSDP_BACKEND": "cpu", "SIGTERM_AT": at})
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc


def _stop_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _resume_matches(out, reference, *overrides: str) -> None:
    reference_dir, reference = reference
    resumed = _cli(*TINY, *TINY_GRPO, *RUN, *overrides, f"trainer.output_dir={out}", "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _comparable(read_metrics(str(out / "metrics.jsonl"))) == _comparable(reference)
    assert read_generations(str(out / "generations.jsonl")) == read_generations(str(reference_dir / "generations.jsonl"))
    expected, got = load_file(str(reference_dir / "final" / "model.safetensors")), \
        load_file(str(out / "final" / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def test_a_sigterm_during_a_rollout_abandons_the_step_and_resume_is_exact(tmp_path, reference):
    overrides = ["trainer.checkpoint_interval=0"]  # the only checkpoint is the one the SIGTERM asks for
    out = tmp_path / "stopped"
    proc = _terminated(out, "rollout", "rl", 3, *overrides)
    checkpoint = out / "checkpoints" / "rl" / "step_000002"
    assert _stop_line(proc).startswith(f"polyfsdp-train: stopped by SIGTERM after rl step 2 (left for the resumed "
                                       f"run: rl step 3); checkpoint saved: {checkpoint}; continue with: ")
    # Step 3 was sampled but never trained: no record, and the checkpoint is step 2's.
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl"] == [1, 2]
    assert not (out / "final").exists()
    _resume_matches(out, reference, *overrides)


def test_a_sigterm_while_an_async_run_samples_ahead_keeps_the_queue_and_resume_is_exact(tmp_path):
    # rollout.max_staleness=1: step 3 samples step 4's batch (the 4th sampling: step 1 drew two);
    # the stop leaves step 2's checkpoint with step 3's batch, drawn during step 2, in its queue.
    overrides = ["trainer.checkpoint_interval=0", "rollout.max_staleness=1"]
    reference = _run(tmp_path / "reference", "full", *RUN, *overrides)
    out = tmp_path / "stopped"
    proc = _terminated(out, "rollout", "rl", 4, *overrides)
    assert "stopped by SIGTERM after rl step 2 (left for the resumed run: rl step 3)" in _stop_line(proc)
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl"] == [1, 2]
    _resume_matches(out, reference, *overrides)


def test_the_evaluation_due_at_the_stopping_boundary_is_left_to_the_resumed_run(tmp_path, reference):
    overrides = ["trainer.checkpoint_interval=0"]
    assert any(r["phase"] == "eval" and r["tag"] == "step" for r in reference[1])
    out = tmp_path / "stopped"
    proc = _terminated(out, "record", "rl", 2, *overrides)
    checkpoint = out / "checkpoints" / "rl" / "step_000002"
    assert f"(left for the resumed run: the evaluation due there); checkpoint saved: {checkpoint};" in \
        _stop_line(proc)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert records[-1]["phase"] == "rl" and records[-1]["step"] == 2  # saved, then stopped: no evaluation
    assert load_plain(checkpoint / "trainer_state.pt")["extra"]["eval_due"] is True
    _resume_matches(out, reference, *overrides)


@pytest.mark.parametrize("at, left", [("eval", "the evaluation due there, rl step 3"), ("eval_end", "rl step 3")])
def test_an_evaluation_under_way_is_abandoned_or_done_again_on_resume(tmp_path, reference, at, left):
    # Interval checkpoints: the boundary's checkpoint exists (evaluation due) before the evaluation
    # starts. A SIGTERM as it starts abandons it; one as it ends stops at the next step's start,
    # and the resumed run evaluates again from the checkpoint, its rows written once.
    overrides = ["trainer.checkpoint_interval=1"]
    out = tmp_path / "stopped"
    proc = _terminated(out, at, "rl", 2, *overrides)
    checkpoint = out / "checkpoints" / "rl" / "step_000002"
    assert f"after rl step 2 (left for the resumed run: {left}); checkpoint saved: {checkpoint};" in _stop_line(proc)
    evaluated = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval" and r["tag"] == "step"]
    assert len(evaluated) == (at == "eval_end")
    _resume_matches(out, reference, *overrides)


def _engine(steps: int = 0):
    return SimpleNamespace(global_step=steps)


def test_the_guard_abandons_only_before_the_first_update():
    stop = StopRequest()
    policy, critic = _engine(), _engine()
    guard = StepGuard(stop, (policy, critic, None), agreed=lambda: stop.requested, backend=None)
    with cancellable(guard.check):
        cancellation_point()  # no SIGTERM: nothing
        stop.requested = True
        with pytest.raises(StepAbandoned):
            cancellation_point()
        critic.global_step += 1  # the critic's update was applied: the step now runs to its end
        cancellation_point()
        policy.global_step += 1
        cancellation_point()
    cancellation_point()  # outside any guard: nothing


def test_the_continuing_command_of_a_multi_node_run_names_its_nodes():
    from polyfsdp.trainer.run.stop import continue_command

    assert continue_command(["a=1"], "/o", 1) == "polyfsdp-train a=1 trainer.output_dir=/o trainer.resume=auto"
    assert continue_command(["a=1"], "/o", 8, local_world_size=8) == \
        "torchrun --nproc_per_node=8 -m polyfsdp.trainer.train a=1 trainer.output_dir=/o trainer.resume=auto"
    # 2 nodes of 8: not --nproc_per_node=16 on one node; the rendezvous is each node's own.
    assert continue_command(["a=1"], "/o", 16, local_world_size=8) == \
        "torchrun --nnodes=2 --nproc_per_node=8 -m polyfsdp.trainer.train a=1 trainer.output_dir=/o " \
        "trainer.resume=auto (on each node, with the rendezvous arguments it was started with)"
