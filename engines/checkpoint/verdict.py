"""One verdict of all ranks on a checkpoint stage: a failure on any rank is the same one-line
error on every rank, so none waits alone in the next collective.

A save's stage that fails (a full disk, an unwritable directory) removes the partial save and
raises :class:`CheckpointSaveError` naming the checkpoint that stays ``latest``; a load whose
DCP read refuses a crafted pickle raises the refusal as one :class:`CheckpointError`.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from polyfsdp.backends.distributed import all_gather_object, all_gather_object_in, barrier, current_rank

from .errors import CheckpointError, CheckpointSaveError
from .files import SafeDcpLoadPlanner, SafeDcpReader
from .layout import latest_checkpoint


# A stage's verdict for a Ctrl-C. DCP catches whatever its stages raise, KeyboardInterrupt
# included, and hands it on inside a CheckpointException: a Ctrl-C during a save was reported as
# "cannot save checkpoint ...: KeyboardInterrupt" (exit 2) instead of stopping the run as one.
INTERRUPTED = "KeyboardInterrupt"


def all_ranks_or_raise(stage, directory: Path, tmp: Path, final: Path, group=None) -> None:
    """Run ``stage`` on this rank; if it failed on any rank, remove the partial save and raise
    the same one-line :class:`CheckpointSaveError` on every rank (KeyboardInterrupt if a rank
    was interrupted by Ctrl-C). ``latest`` is untouched.
    ``group``: the process group of the verdict (a background save's own)."""
    failure = None
    try:
        stage()
    except KeyboardInterrupt:
        failure = INTERRUPTED
    except (OSError, CheckpointException) as exc:
        failure = INTERRUPTED if isinstance(first_cause(exc), KeyboardInterrupt) else failure_text(exc)
    except RuntimeError as exc:
        # torch.save's zip writer reports a failed write as "unexpected pos N vs M", with the
        # OSError as the context; any other RuntimeError is not a save failure.
        if _os_error_in(exc) is None:
            raise
        failure = failure_text(exc)
    gathered = all_gather_object(failure) if group is None else all_gather_object_in(failure, group)
    failures = [f for f in gathered if f is not None]
    if not failures:
        return
    if current_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(group)
    if INTERRUPTED in failures:  # a Ctrl-C: the run stops as a Ctrl-C stops it, on every rank
        raise KeyboardInterrupt
    kept = latest_checkpoint(directory)
    raise CheckpointSaveError(f"cannot save checkpoint {final}: {failures[0]}; "
                              f"{f'{kept} stays the latest checkpoint' if kept else 'there is no earlier checkpoint'}")


def failure_text(exc: BaseException) -> str:
    """The one line a save failure reports: the OSError's text and file when there is one."""
    exc = first_cause(exc)
    # torch.save turns the OSError of a failed write (a full disk) into "unexpected pos N vs M":
    # the OSError it swallowed is still the RuntimeError's context.
    os_error = _os_error_in(exc)
    if os_error is not None:
        return f"{os_error.strerror} ({os_error.filename})" if os_error.filename else os_error.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def _os_error_in(exc: BaseException | None) -> OSError | None:
    """The first OSError with an error text in ``exc``'s chain of causes and contexts."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.strerror:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def first_cause(exc: BaseException) -> BaseException:
    """DCP wraps each rank's error (with a traceback) in a CheckpointException: the first cause."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return next(iter(exc.failures.values()))[0]
    return exc


def safe_dcp_load(state: dict, path: Path) -> None:
    """``dcp.load`` with every pickle in the checkpoint read through an allow-list; a refusal
    (raised on whichever rank read the item, gathered by DCP onto all) is the one-line error."""
    try:
        dcp.load(state, storage_reader=SafeDcpReader(str(path)), planner=SafeDcpLoadPlanner())
    except CheckpointException as exc:
        cause = first_cause(exc)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(f"{path}: {cause}") from None
        if isinstance(cause, KeyboardInterrupt):  # a Ctrl-C while loading (INTERRUPTED says why)
            raise KeyboardInterrupt from None
        raise
