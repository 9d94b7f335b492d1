"""What ``polyfsdp-train`` says when Ctrl-C or SIGTERM lands while it is still starting (importing
torch and transformers takes seconds): one line and exit status 130 (143 for SIGTERM), never an
import traceback nor a silent death by signal.

Kept free of heavy imports: ``trainer/__init__.py`` uses it around the first ``import torch``.
"""
from __future__ import annotations

import signal
import sys
import threading

# Stopped by Ctrl-C (SIGINT) or SIGTERM, the shell's convention 128 + the signal's number.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


def _stopped_while_starting(how: str, status: int) -> SystemExit:
    print(f"polyfsdp-train: {how} while starting (nothing ran, nothing was written)", file=sys.stderr, flush=True)
    return SystemExit(status)


def interrupted_while_starting() -> SystemExit:
    """Print the one line and return the SystemExit (status 130) to raise or read."""
    return _stopped_while_starting("interrupted", EXIT_INTERRUPTED)


def terminated_while_starting() -> SystemExit:
    """Print the one line (worded as a later SIGTERM's, trainer/run/stop.py) and return the SystemExit
    (status 143) to raise or read."""
    return _stopped_while_starting("stopped by SIGTERM", EXIT_TERMINATED)


class TerminatedWhileStarting(BaseException):
    """A SIGTERM before the job's own handler took over; a BaseException, as KeyboardInterrupt is,
    so no ``except Exception`` on the way (an import's, a config check's) swallows it."""


class SigtermWhileStarting:
    """From ``main``'s first line until :meth:`job_starts`, a SIGTERM raises
    :class:`TerminatedWhileStarting` instead of ending the process without a word (Python's
    default). The job's own handler (trainer/run/stop.py's StopRequest, which finishes the step and
    checkpoints) takes over from there; leaving the block restores the caller's handler. Main
    thread only, as signal handlers are."""

    def __init__(self) -> None:
        self._previous = None

    @staticmethod
    def _raise(signum, frame) -> None:
        raise TerminatedWhileStarting

    def __enter__(self) -> "SigtermWhileStarting":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    def job_starts(self) -> None:
        """The job is built: SIGTERM's default action until StopRequest installs its flag."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def rank_prefix(rank: int, prog: str = "polyfsdp-train") -> str:
    """How ``prog`` starts an error line on ``rank`` (torch-free: config errors print it early)."""
    return f"{prog}: error: " if rank == 0 else f"{prog} [rank {rank}]: error: "
