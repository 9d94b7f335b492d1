"""One run per output directory (trainer/output_dir_lock.py): a second polyfsdp-train on a directory
a live run writes to is refused in one line and the first run's files stay whole; a lock left by a
run that is gone (killed and reaped, a zombie, a pid now another process's) is taken over with one
line; a holder that cannot be checked (another host) or an unreadable lock is refused; the lock goes
on every exit."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tests.helpers import HELPERS
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.output_dir_lock import LOCK_FILE, Holder, hold_output_dir, start_time
from polyfsdp.trainer.tracking.metrics import read_metrics

RUN = ["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=4", "trainer.prompts_per_step=4",
       "algo.actor.group_size=2", "data.eval_size=4", "trainer.checkpoint_interval=1", "trainer.progress=off",
       "trainer.plot=false", "trainer.export=false"]
ENV = {**os.environ, "POLYFSDP_BACKEND": ""}


def test_a_second_run_on_a_directory_in_use_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(HELPERS / "hold_at_checkpoint_child.py"), "sft", "1", *RUN,
                              f"trainer.output_dir={out}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert any(line.strip() == "HOLDING" for line in first.stdout), first.stderr.read()[-2000:]
        second = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *RUN, f"trainer.output_dir={out}"],
                                capture_output=True, text=True, timeout=300, env=ENV)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
        assert lines[0] == (f"polyfsdp-train: error: trainer.output_dir {out}: another run is writing to it (pid "
                            f"{first.pid} on host {socket.gethostname()}, since "
                            f"{json.loads((out / LOCK_FILE).read_text())['taken_at']}); wait for it to end or "
                            f"choose another trainer.output_dir"), lines[0]
        first.stdin.write("\n")
        first.stdin.flush()
        first.stdin.close()
        first.stdout.read()
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    records = [(r["phase"], r.get("step"), r.get("tag")) for r in read_metrics(str(out / "metrics.jsonl"))]
    assert records == [("eval", None, "initial"), ("sft", 1, None), ("sft", 2, None), ("eval", None, "after_sft"),
                       ("rl", 1, None), ("rl", 2, None), ("eval", None, "final")]
    assert not (out / LOCK_FILE).exists()


def _ended_process(how: str) -> tuple[int, str | None]:
    """(pid, start time) of a process that has ended: reaped, or a zombie (killed, not reaped yet)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = start_time(child.pid)
    child.send_signal(signal.SIGKILL)
    if how == "zombie":
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    else:
        child.wait()
    return child.pid, started


def _write_lock(out: Path, holder: Holder) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_FILE).write_text(json.dumps(asdict(holder)))


@pytest.mark.parametrize("how", ["reaped", "zombie", "pid reused"])
def test_a_lock_whose_holder_is_gone_is_taken_over_with_one_line(tmp_path, how):
    if how == "pid reused":  # this very pid, but it named a process that started at another time
        stale = replace(Holder.this_process(), started="1")
    else:
        pid, started = _ended_process(how)
        stale = replace(Holder.this_process(), pid=pid, started=started)
    _write_lock(tmp_path, stale)
    said = []
    with hold_output_dir(tmp_path, say=said.append):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["token"] != stale.token
    assert said == [f"trainer.output_dir {tmp_path}: took over the lock of a run that ended without releasing it "
                    f"({stale.describe()}; killed?)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # released, and nothing moved aside is left


def test_a_live_holder_or_one_that_cannot_be_checked_keeps_the_lock(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holders = {"is writing to it": replace(Holder.this_process(), pid=live.pid, started=start_time(live.pid)),
                   "which this host cannot check": replace(Holder.this_process(), host="another-host", pid=1)}
        for words, holder in holders.items():
            _write_lock(tmp_path, holder)
            kept = (tmp_path / LOCK_FILE).read_text()
            with pytest.raises(ConfigError, match=words) as refused:
                with hold_output_dir(tmp_path, say=print):
                    raise AssertionError("ran while another run held the directory")
            assert holder.describe() in str(refused.value)
            assert (tmp_path / LOCK_FILE).read_text() == kept
    finally:
        live.kill()
        live.wait()
    (tmp_path / LOCK_FILE).write_text("")  # not a lock polyfsdp-train wrote (or cut short by a full disk)
    with pytest.raises(ConfigError, match="is not a lock polyfsdp-train can read; if no run is writing"):
        with hold_output_dir(tmp_path, say=print):
            pass


def test_the_lock_goes_on_an_exception_and_stays_if_it_is_no_longer_ours(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with hold_output_dir(tmp_path, say=print):
            assert (tmp_path / LOCK_FILE).is_file()
            raise KeyboardInterrupt
    assert not (tmp_path / LOCK_FILE).exists()
    other = Holder.this_process()
    with hold_output_dir(tmp_path, say=print):
        _write_lock(tmp_path, other)  # e.g. removed by hand and taken by another run meanwhile
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == other.token


@pytest.mark.parametrize("how", ["fifo", "link to a fifo"])
def test_a_lock_that_is_no_regular_file_is_refused_without_reading_it(tmp_path, how):
    """A crafted directory's run.lock that never ends reading (a FIFO with no writer blocks forever,
    a link to /dev/zero fills memory) is refused at once, like any lock polyfsdp-train cannot read."""
    import threading

    fifo = tmp_path / ("elsewhere" if how == "link to a fifo" else LOCK_FILE)
    os.mkfifo(fifo)
    if how == "link to a fifo":
        (tmp_path / LOCK_FILE).symlink_to(fifo)
    outcome = []

    def take():
        try:
            with hold_output_dir(tmp_path, say=print):
                outcome.append("ran")
        except ConfigError as exc:
            outcome.append(str(exc))

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    taker.join(timeout=10)
    blocked = taker.is_alive()
    while taker.is_alive():  # blocked opening the FIFO: a writer that closes at once sets it free
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader at this instant
            pass
        taker.join(timeout=0.1)
    assert not blocked, "reading run.lock blocked"
    assert outcome == [f"trainer.output_dir {tmp_path}: {tmp_path / LOCK_FILE} is not a lock polyfsdp-train can "
                       f"read; if no run is writing to this directory, delete it and run again"], outcome
