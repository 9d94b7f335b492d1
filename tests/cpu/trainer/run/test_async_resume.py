"""Asynchronous RL (``rollout.max_staleness``) resumes exactly: runs SIGKILLed during the
sampling of a batch ahead, the rollout engine's weight sync, an optimizer update and the write
of a checkpoint, each resumed with ``trainer.resume=auto``, end with the records of the
uninterrupted run, for k=1 and k=2 (the checkpoint holds the batches sampled for later steps;
without them the resumed run would sample them with newer weights). The records say how stale
each trained batch was: min(step - 1, k)."""
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import HELPERS
from polyfsdp.trainer.tracking.metrics import TIMING_KEYS, read_metrics

CHILD = os.path.join(HELPERS, "async_rl_kill_child.py")
JOB = ["trainer.sft_steps=2", "trainer.rl_steps=8", "trainer.checkpoint_interval=2", "trainer.eval_interval=0",
       "trainer.prompts_per_step=4", "algo.actor.group_size=4", "algo.actor.max_new_tokens=6", "data.eval_size=4",
       "trainer.sft_batch_size=8", "rollout.engine=builtin", "trainer.export=false", "trainer.plot=false",
       "trainer.progress=lines"]
# (point, RL step) of each kill in turn; each resumed run goes on from the newest checkpoint.
KILLS = {1: [("sampling", 3), ("sync", 5), ("update", 7), ("checkpoint", 8)], 2: [("update", 4)]}


def _comparable(out):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(str(out / "metrics.jsonl"))]


def _run(args, timeout=600):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "POLYFSDP_BACKEND": "cpu"})


@pytest.mark.parametrize("k", sorted(KILLS))
def test_kill_9_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path, k):
    job = [*JOB, f"rollout.max_staleness={k}"]
    reference = _run(["-m", "polyfsdp.trainer.train", *job, f"trainer.output_dir={tmp_path / 'reference'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    records = _comparable(tmp_path / "reference")
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["async/staleness"] for r in rl] == [float(min(step, k)) for step in range(8)]
    out = tmp_path / "killed"
    for point, step in KILLS[k]:
        killed = _run([CHILD, point, str(step), *job, f"trainer.output_dir={out}", "trainer.resume=auto"])
        assert killed.returncode == -signal.SIGKILL, (point, step, killed.stdout[-2000:], killed.stderr[-3000:])
    resumed = _run(["-m", "polyfsdp.trainer.train", *job, f"trainer.output_dir={out}", "trainer.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming rl from" in resumed.stdout
    assert _comparable(out) == records
