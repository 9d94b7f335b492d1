"""SIGTERM, what schedulers send before preemption: finish the step, checkpoint, stop.

The handler only sets a flag; the job looks at it at each step boundary, where every rank
agrees on it (one all-reduce, so a rank that got no signal stops with the others instead of
waiting in a collective), saves a checkpoint and raises :class:`Preempted`.
"""
from __future__ import annotations

import shlex
import signal
import threading

from ..errors import Preempted  # noqa: F401 (re-exported: its old home)
from ..startup import EXIT_TERMINATED  # noqa: F401 (re-exported) the status of a run stopped by SIGTERM


# The keys a continuation sets itself; the rest of the user's overrides are repeated as given.
_CONTINUATION_KEYS = ("trainer.output_dir", "trainer.resume")


def continue_command(overrides: list[str], output_dir, world_size: int) -> str:
    """The command that continues a stopped run: the same overrides (a default run's output
    directory is a fresh timestamp, so it is named) with ``trainer.resume=auto``."""
    kept = [o for o in overrides if o.lstrip("+~").partition("=")[0] not in _CONTINUATION_KEYS]
    launcher = ["polyfsdp-train"] if world_size <= 1 else \
        ["torchrun", f"--nproc_per_node={world_size}", "-m", "polyfsdp.trainer.train"]
    return shlex.join([*launcher, *kept, f"trainer.output_dir={output_dir}", "trainer.resume=auto"])


class StopRequest:
    """A SIGTERM flag, installed for the duration of a ``with`` block (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
