"""Cancellation points: the places inside a training step where the caller may abandon it.

A SIGTERM from a scheduler comes with a grace period (30 s by default under Slurm and
Kubernetes) that a whole step on a real model outlasts. The engine calls
:func:`cancellation_point` before each micro-batch of its forward (and forward-backward)
passes; the trainer installs, around a step, a check that raises to abandon the step while no
optimizer update has been applied yet (trainer/run/stop.py). Without an installed check a
cancellation point does nothing, so the engine stays usable on its own.

Every rank reaches the same cancellation points in the same order (micro-batch counts are
equal over ranks: engine.py's ``_micro_batches``), so a check may hold a collective.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

_checks: list[Callable[[], None]] = []


def cancellation_point() -> None:
    """Run the innermost installed check (it raises to abandon the work); nothing without one."""
    if _checks:
        _checks[-1]()


@contextmanager
def cancellable(check: Callable[[], None]) -> Iterator[None]:
    """Install ``check`` for the cancellation points reached inside the block."""
    _checks.append(check)
    try:
        yield
    finally:
        _checks.pop()
