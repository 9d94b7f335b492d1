"""The checkpoint's one-line errors, in a leaf module: every module of the package raises them
without an import circle."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or not safe to load (one-line message)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not match its manifest (missing, truncated, altered, unlisted):
    ``trainer.resume=auto`` skips it for an older one."""


class CheckpointSaveError(CheckpointError, OSError):
    """A save that failed (a full disk, an unwritable directory) on some rank; raised on every
    rank, after the partial save is removed. Also an OSError: it is one."""
