"""The keeper of one rollout server: ``python -m polyfsdp.trainer.rollout.servers.supervisor
PARENT_PID [--cores 1,2] -- COMMAND...`` (``--cores``: the host cores the server's every process
runs on, the CPU's ``rollout.server.devices``; default: the trainer's).

polyfsdp never starts a vLLM server directly: a server is three processes (the API server, its
engine core, its workers), and a trainer killed with ``kill -9`` runs no cleanup. This keeper
runs the command in a process group of its own and ends that whole group when

- the trainer (``PARENT_PID``) is gone: the kernel's parent-death signal (Linux) wakes it at
  once, and a poll of its parent catches the same elsewhere;
- it is asked to stop (SIGTERM/SIGINT/SIGHUP: what :class:`ServerProcess.stop` sends);
- the server exits by itself (its engine core or workers may outlive it).

The group gets SIGTERM (vLLM shuts down cleanly), then SIGKILL after ``GRACE_S``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 15.0
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def _signal_on_parent_death(sig: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass  # not Linux: the poll of the parent below still notices, within POLL_S


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_group(child: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to the child's whole process group, SIGKILL to what is left after ``grace_s``."""
    pgid = child.pid  # start_new_session: the child leads its own group
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        child.poll()
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
    child.wait()


def main(argv: list[str]) -> int:
    cores = None
    if len(argv) > 2 and argv[1] == "--cores":
        cores, argv = argv[2], argv[:1] + argv[3:]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m polyfsdp.trainer.rollout.servers.supervisor PARENT_PID [--cores 1,2] -- COMMAND...",
              file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    if cores is not None and hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the OS places it
        try:  # inherited by the server and every process it starts
            os.sched_setaffinity(0, {int(core) for core in cores.split(",")})
        except (OSError, ValueError) as exc:
            print(f"OSError: cannot run the rollout server on cores {cores} (rollout.server.devices): {exc}",
                  file=sys.stderr)
            return 1
    _signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != parent:  # the trainer died before the signal was armed
        return 1
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.append(True))
    child = subprocess.Popen(command, start_new_session=True)
    while child.poll() is None and not stop and os.getppid() == parent:
        time.sleep(POLL_S)
    code = child.poll()
    end_group(child)
    return 0 if code is None else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
