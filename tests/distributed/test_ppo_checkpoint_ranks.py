"""algo=ppo on 2 ranks: the actor's and the critic's shards of every rank go into one
checkpoint, and a run continued from it follows the uninterrupted run's curve exactly."""
from __future__ import annotations

from test_trainer_torchrun import _launch

from polyfsdp.engines.checkpoint import checkpoint_parts
from polyfsdp.trainer.tracking.metrics import TIMING_KEYS, read_metrics

PPO = ["algo=ppo", "trainer.sft_steps=0", "trainer.export=false", "trainer.checkpoint_interval=1",
       "trainer.keep_checkpoints=1"]


def _curve(out):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(str(out / "metrics.jsonl"))]


def test_a_two_rank_ppo_checkpoint_holds_both_models_and_resumes_the_same_curve(tmp_path):
    full = _launch(tmp_path / "full", 2, *PPO)
    assert full.returncode == 0, full.stderr[-3000:]

    out = tmp_path / "continued"
    first = _launch(out, 2, *PPO, "trainer.rl_steps=1")  # stops after step 1 (and its final evaluation)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = out / "checkpoints" / "rl" / "step_000001"
    assert checkpoint_parts(checkpoint) == ["critic"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["rl"]
    resumed = _launch(out, 2, *PPO, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming rl from {checkpoint}" in resumed.stdout
    assert _curve(out) == _curve(tmp_path / "full")
