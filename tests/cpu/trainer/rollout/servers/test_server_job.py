"""polyfsdp-train with ``rollout.engine=vllm_server`` end to end: every GRPO step's server
log-probs equal the trainer's (the mismatch metric), the servers' logs land in the run
directory; a trainer killed with SIGKILL leaves no server process behind (the keeper ends each
server's process group), and the resumed run continues the uninterrupted run's records exactly
(servers start afresh from the checkpoint's weights; each row draws with its own seed)."""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from polyfsdp.trainer.tracking.metrics import TIMING_KEYS, read_metrics
from tests.helpers.kill_at_checkpoint import kill_after_checkpoint
from tests.cpu.trainer.rollout.test_vllm_job import JOB
from tests.helpers.vllm_cases import require_vllm

SERVER = ["rollout.engine=vllm_server", "rollout.vllm.kv_cache_mb=64", "trainer.rl_steps=4",
          "trainer.checkpoint_interval=2", "trainer.export=false", "trainer.progress=lines"]


# Set in this test's environment, which the trainer, its keepers and their vLLM servers inherit:
# the processes it looks for are this test's own, whatever else runs on the machine (CI runs the
# vLLM stage beside the main suite, whose keeper tests start keepers of their own).
RUN_MARK = "POLYFSDP_TEST_SERVER_JOB_RUN"


def _processes() -> list[tuple[int, int, list[str]]]:
    """``(pid, process group, argv)`` of every process of this test's runs now (``RUN_MARK`` in
    its environment), read from /proc: ``ps`` cuts its ``args`` column at ``$COLUMNS`` (CI sets
    it), which hid a long interpreter path's ``-m``."""
    mark = f"{RUN_MARK}={os.environ.get(RUN_MARK, '')}".encode()
    rows = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
            with open(f"/proc/{entry}/stat") as f:
                pgid = int(f.read().rsplit(")", 1)[1].split()[2])
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
            continue  # ended while we looked, or not ours to read (so not this test's)
        rows.append((int(entry), pgid, argv))
    return rows


def _runs_module(argv: list[str], module: str) -> bool:
    """Whether ``argv`` is ``python -m module ...`` (not a command line that merely names it, as
    a keeper's holds its server's)."""
    return argv[1:3] == ["-m", module]


def running_server_processes(expect_up: bool = False) -> list[int]:
    """The keepers, the vLLM API servers and every process of the API servers' groups (their
    engine cores and workers) of this test's runs, running now; with ``expect_up``, a keeper and an
    API server must be among them (a run's server is up while it trains)."""
    rows = _processes()
    groups = {pgid for _, pgid, argv in rows if _runs_module(argv, "vllm.entrypoints.openai.api_server")}
    found = [pid for pid, pgid, argv in rows
             if pgid in groups or _runs_module(argv, "polyfsdp.trainer.rollout.servers.supervisor")]
    if expect_up:
        argv = {pid: args for pid, _, args in rows}
        for module in ("polyfsdp.trainer.rollout.servers.supervisor", "vllm.entrypoints.openai.api_server"):
            assert any(_runs_module(argv.get(pid, []), module) for pid in found), (module, found)
    return found


def wait_gone(pids, timeout=60.0) -> list[int]:
    """Those of ``pids`` still running (zombies aside) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 not open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] == "Z"]
        if not alive:
            return []
        time.sleep(0.5)
    return alive


@pytest.mark.extended  # test_server_async.py's job carries the kill checks in CI (one server job, not two)
def test_kill_leaves_no_server_and_resume_continues_the_same_records(tmp_path, monkeypatch):
    require_vllm()
    monkeypatch.setenv(RUN_MARK, uuid.uuid4().hex)
    full = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *JOB, *SERVER,
                           f"trainer.output_dir={tmp_path / 'full'}"], capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-3000:]
    reference = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))
    grpo = [r for r in reference if r["phase"] == "rl"]
    assert len(grpo) == 4 and all(r["rollout_mismatch_abs_max"] < 1e-5 for r in grpo), grpo
    assert (tmp_path / "full" / "rollout_servers" / "server_0.log").is_file()
    assert running_server_processes() == []  # a finished run stopped its servers

    out = tmp_path / "killed"
    started = []
    proc, _ = kill_after_checkpoint([*JOB, *SERVER, f"trainer.output_dir={out}"],
                                    before_kill=lambda: started.extend(running_server_processes(expect_up=True)))
    assert proc.returncode == -signal.SIGKILL
    left = wait_gone(started)
    assert left == [], f"a rollout server outlived its trainer: {[r for r in _processes() if r[0] in left]}"
    resumed = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *JOB, *SERVER,
                              f"trainer.output_dir={out}", "trainer.resume=auto"], capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming rl from" in resumed.stdout
    comparable = lambda records: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]  # noqa: E731
    assert comparable(read_metrics(str(out / "metrics.jsonl"))) == comparable(reference)
