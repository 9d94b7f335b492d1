"""algo=ppo checkpoints the actor, the critic and the trainer position as one unit: a run that
dies at any point of a save (keep_checkpoints=1) resumes with trainer.resume=auto and ends where
an uninterrupted run does; a damaged critic makes `auto` fall back to the newest intact pair; a
checkpoint from when the critic was saved apart is refused in one line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.helpers import HELPERS
from tests.cpu.trainer.test_cli import _comparable

from polyfsdp.engines.checkpoint import TRAINER_STATE_FILE
from polyfsdp.engines.checkpoint.files import load_plain, save_plain, write_manifest
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main

CHILD = os.path.join(HELPERS, "checkpoint_crash_child.py")
PPO = ["algo=ppo", "trainer.sft_steps=0", "trainer.rl_steps=3", "trainer.prompts_per_step=4",
       "algo.actor.group_size=4", "data.eval_size=4", "trainer.progress=off", "trainer.plot=false",
       "trainer.export=false", "trainer.checkpoint_interval=1", "trainer.keep_checkpoints=1"]
CRASH_STEP = 2  # step_000001 is the one checkpoint kept when its save starts
# The points of one save, in order (checkpoint_crash_child.py counts them): before the shards,
# the RNG file, the trainer state, the manifest, the rename into place, the `latest` pointer,
# the rename of the old checkpoint out of the way; halfway through deleting it; after the save.
SAVE_POINTS = ["dcp.save", "save_plain", "save_plain", "write_manifest", "rename", "write_pointer", "rename",
               "rmtree", "returned"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo") / "uninterrupted"
    assert main([*PPO, f"trainer.output_dir={out}"]) == 0
    return read_metrics(str(out / "metrics.jsonl"))


def _crash(out, point):
    return subprocess.run([sys.executable, CHILD, str(CRASH_STEP), str(point), *PPO, f"trainer.output_dir={out}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "POLYFSDP_BACKEND": "cpu"})


@pytest.mark.parametrize("point", range(1, len(SAVE_POINTS) + 1),
                         ids=[f"{n}-{name}" for n, name in enumerate(SAVE_POINTS, 1)])
def test_a_crash_at_any_point_of_a_ppo_save_resumes_to_the_uninterrupted_run(tmp_path, reference, point, capsys):
    out = tmp_path / "run"
    crashed = _crash(out, point)
    assert crashed.returncode == 137, crashed.stderr[-3000:]
    assert f"CRASH POINT {point} {SAVE_POINTS[point - 1]}" in crashed.stderr, crashed.stderr[-3000:]

    assert main([*PPO, f"trainer.output_dir={out}", "trainer.resume=auto"]) == 0, capsys.readouterr().err
    assert _comparable(read_metrics(str(out / "metrics.jsonl"))) == _comparable(reference)
    # One unit, pruned as one: the newest checkpoint only, and nothing the crash left behind.
    assert sorted(os.listdir(out / "checkpoints")) == ["rl"]
    assert sorted(os.listdir(out / "checkpoints" / "rl")) == ["latest", "step_000003"]


def _flip_a_critic_byte(checkpoint):
    """Damage a byte of the critic's value head in the checkpoint's shards (found through DCP's
    index of where each tensor lies), as a bad disk would."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    (index, info), = [(i, s) for i, s in storage.items() if i.fqn == "parts.critic.model.lm_head.weight"]
    shard = checkpoint / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_a_damaged_critic_falls_back_to_the_newest_intact_actor_and_critic(tmp_path, reference, capsys):
    out = tmp_path / "run"
    assert main([*PPO, f"trainer.output_dir={out}", "trainer.keep_checkpoints=2"]) == 0
    grpo = out / "checkpoints" / "rl"
    _flip_a_critic_byte(grpo / "step_000003")
    capsys.readouterr()

    assert main([*PPO, f"trainer.output_dir={out}", "trainer.keep_checkpoints=2", "trainer.resume=auto"]) == 0
    said = capsys.readouterr().out
    assert f"trainer.resume=auto: skipping {grpo / 'step_000003'}: {grpo / 'step_000003'}: __0_0.distcp does " \
           f"not match its checksum" in said, said
    assert f"resuming rl from {grpo / 'step_000002'}" in said, said
    assert _comparable(read_metrics(str(out / "metrics.jsonl"))) == _comparable(reference)


def test_a_checkpoint_whose_critic_was_saved_apart_is_refused_in_one_line(tmp_path, capsys):
    # What a polyfsdp before one-unit checkpoints left: checkpoints/grpo/step_N without the
    # critic, checkpoints/critic/step_N beside it.
    out = tmp_path / "run"
    assert main([*PPO, "trainer.rl_steps=1", f"trainer.output_dir={out}"]) == 0
    actor = out / "checkpoints" / "rl" / "step_000001"
    state = load_plain(actor / TRAINER_STATE_FILE)
    del state["parts"]
    save_plain(state, actor / TRAINER_STATE_FILE)
    write_manifest(actor)
    (out / "checkpoints" / "critic" / "step_000001").mkdir(parents=True)
    capsys.readouterr()

    assert main([*PPO, f"trainer.output_dir={out}", "trainer.resume=auto"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"polyfsdp-train: error: trainer.resume: {actor} holds no critic: it was written by a polyfsdp "
                   f"that kept algo=ppo's critic apart (in {out / 'checkpoints' / 'critic'}), which this one does "
                   f"not load; finish that run with the polyfsdp that started it, or start a new "
                   f"trainer.output_dir"], err
