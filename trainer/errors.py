"""Every error ``polyfsdp-train`` and ``polyfsdp-eval`` report to the user as one line.

A leaf module: it imports nothing of polyfsdp and nothing heavy, so any trainer module (the
torch-free config composition included) can raise or catch these without importing the module
that happens to raise them, and no import circle forms through an error class. The entry points
(trainer/train.py, trainer/eval_cli.py) print ``str(exc)`` after ``polyfsdp-train: error:``.

The engine's and the backends' own errors stay with them (lower layers never import the trainer):
``polyfsdp.engines.config.ConfigFieldError`` (a bad engine/model/optimizer field),
``polyfsdp.engines.checkpoint.errors.CheckpointError`` (a damaged or unwritable checkpoint) and
``polyfsdp.backends.BackendUnavailableError`` (a backend this host cannot run).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake; ``str()`` is one line naming the key and what was expected."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class DataError(ValueError):
    """A data file that cannot be used (missing, unreadable, missing fields); one-line message."""


class RewardError(DataError):
    """A reward function that failed or returned something unusable; one-line message."""


class RankError(Exception):
    """The first failing rank's error, raised on every rank; ``polyfsdp-train`` prints it once (rank 0).
    trainer/rank_errors.py raises it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank


class MetricsWriteError(Exception):
    """A metrics record that could not be written (e.g. a full disk); one-line message."""


class TrackerStartError(RuntimeError):
    """An experiment tracker that cannot start; the message is one line naming the fix."""


class Preempted(Exception):
    """Raised after the checkpoint a SIGTERM asked for is saved (trainer/run/stop.py)."""

    def __init__(self, phase: str, step: int, checkpoint, abandoned: str = "") -> None:
        # ``abandoned``: what was left undone to stop sooner (an evaluation, a step before its first update).
        note = f" ({abandoned})" if abandoned else ""
        super().__init__(f"stopped by SIGTERM after {phase} step {step}{note}; checkpoint saved: {checkpoint}")
        self.phase, self.step, self.checkpoint = phase, step, checkpoint
