"""What a failing rollout server's line says besides the failure itself: the server's log and the
root cause found in it. A request's answer rarely holds the cause: vLLM answers ``HTTP 500:
EngineCore encountered an issue`` and a killed server only refuses connections, while the
exception that stopped it is in its log. One function, :func:`failure_line`, makes the line for
every failure of a server polyfsdp started (a refused connection, an HTTP error, a timeout, an
exit while starting or running).
"""
from __future__ import annotations

import re

LOG_TAIL_LINES = 400  # a failure's traceback sits near the end; a long-running server's log may be large

_ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")
# An error line that only points at another one: vLLM's "See root cause above" and "See stack trace
# (above) for the root cause" follow the exception that is the cause.
_POINTERS = ("root cause", "stack trace")


def log_root_cause(path: str) -> str:
    """The most telling line of a server's log: its last error that is not a pointer to another one
    (the exception line that ends the last traceback), as ``last error: ...``; else its last line,
    as ``last line: ...``. A warning that mentions an error is not one."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - (LOG_TAIL_LINES << 9)))  # the tail only: a server's log grows all run
            tail = fh.read().decode("utf-8", "replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError as exc:
        return f"no log ({exc.strerror or exc})"
    lines = [line.strip() for line in tail if line.strip()]
    for line in reversed(lines):
        match = _ERROR_LINE.search(line)
        if match and "WARNING" not in line and not any(pointer in line for pointer in _POINTERS):
            return "last error: " + " ".join(f"{match.group(1)}: {match.group(2)}".split())[:400]
    return "last line: " + " ".join(lines[-1].split())[:400] if lines else "empty log"


def failure_line(what: str, log_path: str, exit_code: int | None = None) -> str:
    """``what`` failed (the server, the request and its error: one line), then whether the server
    exited and with what code, its log's path and the root cause found in that log."""
    exited = "" if exit_code is None else f"; the server exited with code {exit_code}"
    return f"{what}{exited}; server log {log_path}, {log_root_cause(log_path)}"
