"""SIGTERM (preemption) and damaged checkpoints at the level of `polyfsdp-train`: a terminated
run saves at the next step boundary and `trainer.resume=auto` continues it exactly; `auto`
skips checkpoints that fail their manifest, an explicit damaged one is one line."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import torch
from safetensors.torch import load_file
from tests.helpers import HELPERS
from tests.cpu.trainer.test_cli import TINY, TINY_GRPO, _assert_one_line_error, _cli, _comparable, _run

from polyfsdp.trainer.tracking.metrics import read_metrics

# No interval checkpoints: the one SIGTERM asks for is the only one there is.
OVERRIDES = [*TINY, *TINY_GRPO, "trainer.sft_steps=2", "trainer.rl_steps=4", "trainer.checkpoint_interval=0",
             "trainer.plot=false"]


def _weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


def test_sigterm_saves_at_the_step_boundary_and_resume_continues_exactly(tmp_path):
    reference_dir, reference = _run(tmp_path, "full", *OVERRIDES[len(TINY) + len(TINY_GRPO):])

    out = tmp_path / "preempted"
    proc = subprocess.run([sys.executable, os.path.join(HELPERS, "cli_sigterm_child.py"), "rl", "2", *OVERRIDES,
                           f"trainer.output_dir={out}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "POLYFSDP_BACKEND": "cpu"})
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    checkpoint = out / "checkpoints" / "rl" / "step_000002"
    continuation = shlex.join(["polyfsdp-train", *OVERRIDES, f"trainer.output_dir={out}", "trainer.resume=auto"])
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"polyfsdp-train: stopped by SIGTERM after rl step 2; checkpoint saved: {checkpoint}; "
        f"continue with: {continuation}"], proc.stderr
    assert not (out / "final").exists()  # it stopped: steps 3-4 did not run

    # The line is the command: run it as printed.
    resumed = _cli(*shlex.split(continuation)[1:])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming rl from {checkpoint}" in resumed.stdout
    records = read_metrics(str(out / "metrics.jsonl"))
    assert _comparable(records) == _comparable(reference)
    expected = _weights(reference_dir)
    got = _weights(out)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_resume_auto_skips_a_damaged_checkpoint_and_an_explicit_one_is_one_line(tmp_path):
    overrides = [*OVERRIDES[len(TINY) + len(TINY_GRPO):], "trainer.checkpoint_interval=1", "trainer.export=false"]
    out, _ = _run(tmp_path, "run", *overrides)
    grpo = out / "checkpoints" / "rl"
    newest, older = grpo / "step_000004", grpo / "step_000003"
    _truncate(newest / "trainer_state.pt")

    explicit = _cli(*TINY, *TINY_GRPO, *overrides, f"trainer.output_dir={out}", f"trainer.resume={newest}")
    _assert_one_line_error(explicit, f"trainer.resume: cannot load {newest}: {newest}: trainer_state.pt has ")

    auto = _cli(*TINY, *TINY_GRPO, *overrides, f"trainer.output_dir={out}", "trainer.resume=auto",
                "trainer.rl_steps=4")
    assert auto.returncode == 0 and "Traceback" not in auto.stderr, auto.stderr[-2000:]
    assert f"trainer.resume=auto: skipping {newest}: {newest}: trainer_state.pt has " in auto.stdout
    assert f"resuming rl from {older}" in auto.stdout
    # It redid step 4 from step 3 and replaced the damaged copy with an intact one.
    assert "checkpoint saved: " + str(newest) in auto.stdout
    from polyfsdp.engines.checkpoint import verify_checkpoint
    verify_checkpoint(newest)


def test_disk_full_during_a_checkpoint_stops_with_one_line_and_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    import errno

    from polyfsdp.engines import checkpoint
    from polyfsdp.engines.checkpoint import latest_checkpoint
    from polyfsdp.trainer.train import main

    real_save_plain, calls = checkpoint.save_plain, []

    def full_on_the_second_checkpoint(obj, path):
        calls.append(path)
        if "step_000002" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_save_plain(obj, path)

    monkeypatch.setattr(checkpoint, "save_plain", full_on_the_second_checkpoint)
    out = tmp_path / "run"
    code = main([*TINY, "algo=sft", "trainer.sft_steps=3", "trainer.checkpoint_interval=1",
                 f"trainer.output_dir={out}"])
    sft = out / "checkpoints" / "sft"
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"polyfsdp-train: error: cannot save checkpoint {sft / 'step_000002'}: No space left on device "
                      f"({sft / '.tmp-step_000002' / 'rng_rank0.pt'}); {sft / 'step_000001'} stays the latest "
                      f"checkpoint"), err[0]
    assert latest_checkpoint(sft) == sft / "step_000001" and sorted(p.name for p in sft.iterdir()) == \
        ["latest", "step_000001"]


def test_kill_9_during_a_background_checkpoint_write_loses_nothing(tmp_path):
    # Checkpoints at RL steps 2, 4 and 5; step 4's write is still running when step 5 has
    # been trained and logged, and the kill lands then.
    overrides = [*OVERRIDES[len(TINY) + len(TINY_GRPO):], "trainer.rl_steps=5", "trainer.checkpoint_interval=2",
                 "trainer.export=false"]
    _, reference = _run(tmp_path, "full", *overrides)  # synchronous checkpoints: the same numbers

    out = tmp_path / "killed"
    run = [*TINY, *TINY_GRPO, *overrides, f"trainer.output_dir={out}", "trainer.async_checkpoint=true"]
    killed = subprocess.run([sys.executable, os.path.join(HELPERS, "async_kill_child.py"), "4", *run],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "POLYFSDP_BACKEND": "cpu"})
    assert killed.returncode == -9 and "KILL during the background write" in killed.stderr, killed.stderr[-2000:]
    rl = out / "checkpoints" / "rl"
    assert (rl / "latest").read_text().strip() == "step_000002"
    assert (rl / ".tmp-step_000004").is_dir() and not (rl / "step_000004").exists()
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl"] == [1, 2, 3, 4, 5]

    resumed = _cli(*run, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming rl from {rl / 'step_000002'}" in resumed.stdout
    assert f"checkpoint saved: {rl / 'step_000005'}" in resumed.stdout
    assert _comparable(read_metrics(str(out / "metrics.jsonl"))) == _comparable(reference)
    assert sorted(p.name for p in rl.iterdir()) == ["latest", "step_000004", "step_000005"]
