"""A run SIGKILLed right after a checkpoint and resumed ends exactly where an uninterrupted run does."""
import os
import signal
import subprocess
import sys
import threading

import torch

from tests.helpers import HELPERS

CHILD = os.path.join(HELPERS, "resume_child.py")
STEPS, SAVE_AT = 6, 3
TIMEOUT_S = 300


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # Same thread count in every child, so the runs do identical arithmetic.
    env.update({"POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _command(mode, ckpt, out=None):
    cmd = [sys.executable, CHILD, "--mode", mode, "--ckpt", str(ckpt), "--steps", str(STEPS),
           "--save-at", str(SAVE_AT)]
    return cmd + (["--out", str(out)] if out else [])


def _losses_from(lines):
    return [float(line.split("loss=")[1]) for line in lines if line.startswith("step=")]


def test_sigkilled_run_resumed_from_checkpoint_matches_uninterrupted_run_bitwise(tmp_path):
    env = _env()
    # Logs go to files: an undrained pipe could block a child, and stderr could interleave.
    full_log, kill_log = open(tmp_path / "full.log", "w"), open(tmp_path / "kill.err", "w")
    full = subprocess.Popen(_command("full", tmp_path / "unused", tmp_path / "full.pt"), env=env,
                            stdout=full_log, stderr=subprocess.STDOUT, text=True)
    killed = subprocess.Popen(_command("kill", tmp_path / "ckpt"), env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=kill_log, text=True)
    watchdog = threading.Timer(TIMEOUT_S, lambda: (full.kill(), killed.kill()))
    watchdog.start()
    try:
        seen = []
        for line in killed.stdout:
            seen.append(line.rstrip("\n"))
            if line.startswith("CHECKPOINT_SAVED"):
                killed.send_signal(signal.SIGKILL)  # from outside, right after the checkpoint
                break
        assert seen and seen[-1] == f"CHECKPOINT_SAVED {SAVE_AT}", (tmp_path / "kill.err").read_text()[-3000:]
        killed.wait()
        assert killed.returncode == -signal.SIGKILL
        full.wait()
        assert full.returncode == 0, (tmp_path / "full.log").read_text()[-3000:]
    finally:
        watchdog.cancel()
        for handle in (full_log, kill_log, killed.stdin, killed.stdout):
            handle.close()
        for proc in (full, killed):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step_{SAVE_AT:06d}"

    resumed = subprocess.run(_command("resume", tmp_path / "ckpt", tmp_path / "resumed.pt"), env=env,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    reference = torch.load(tmp_path / "full.pt")
    result = torch.load(tmp_path / "resumed.pt")
    assert len(reference["losses"]) == STEPS and result["start"] == SAVE_AT
    # Bitwise: the same float losses, before the kill and after the resume, and the same weights.
    assert _losses_from(seen) == reference["losses"][:SAVE_AT]
    assert result["losses"] == reference["losses"][SAVE_AT:]
    assert reference["params"].keys() == result["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(result["params"][name], value), name
