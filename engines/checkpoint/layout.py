"""The directory of a run's checkpoints: its names, and the atomic moves that keep it readable.

Layout of a checkpoint root::

    step_000120/            a complete checkpoint (only ever created by an atomic rename)
    .tmp-step_000130/       a save in progress (or one that crashed): never read
    .tmp-del-step_000110/   an old checkpoint being deleted (or whose deletion crashed): never read
    latest                  text file naming the newest complete checkpoint

Only this module names, renames or deletes checkpoint directories and the ``latest`` pointer;
what goes inside one is ``__init__.py``'s (the save and load) and ``files.py``'s
(the manifest). A crash at any point leaves ``latest`` naming a complete checkpoint.

A checkpoint root may come from someone else: ``latest`` is followed only to a ``step_*``
directory of the root itself (not a symbolic link), whatever else it names is refused; what this
module deletes or overwrites that is a symbolic link (a ``.tmp-*`` leftover, ``latest.tmp``) loses
the link only, never its target.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from .errors import CheckpointError

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = f"{TMP_PREFIX}del-"  # an old checkpoint renamed out of the way before it is deleted
TRAINER_STATE_FILE = "trainer_state.pt"  # written last of a checkpoint's own files: its presence marks one
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of ``step`` (``step_000123``)."""
    return f"step_{step:06d}"


def fsync_dir(path: Path) -> None:
    """Make a rename/replace in ``path`` durable across power loss, not just process death."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pointer(directory: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (temp file + ``os.replace``)."""
    tmp = directory / f"{LATEST_FILE}.tmp"
    # A leftover may be a crafted run's link to any file: opening it would overwrite that file.
    tmp.unlink(missing_ok=True)
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST_FILE)
    fsync_dir(directory)


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint (a ``step_*`` directory with its trainer state)."""
    return path.is_dir() and STEP_DIR.match(path.name) is not None and (path / TRAINER_STATE_FILE).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest step first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def _pointed(directory: Path, pointer: Path) -> Path:
    """The directory ``pointer`` (a ``latest``) names: a ``step_*`` of ``directory`` itself, no
    symbolic link on the way; anything else (an absolute or ``../..`` path, a link to elsewhere)
    is a :class:`CheckpointError` naming the pointer."""
    refused = "refused: a run's checkpoints are read only from its own directory"
    if pointer.is_symlink():
        raise CheckpointError(f"{pointer}: a symbolic link (to {os.readlink(pointer)}); {refused}")
    name = pointer.read_text().strip()
    if STEP_DIR.match(name) is None:
        raise CheckpointError(f"{pointer}: names {name!r}, which is not a step_* checkpoint of {directory}; {refused}")
    target = directory / name
    if target.is_symlink():
        raise CheckpointError(f"{pointer}: names {name}, a symbolic link (to {os.readlink(target)}); {refused}")
    return target


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or the newest complete one if the pointer is missing
    or stale; None when there is none. Temporary (in-progress or crashed) saves are ignored,
    and so is, when scanning, a ``step_*`` that is a symbolic link; a pointer naming anything
    but a ``step_*`` directory of ``directory`` is refused (:func:`_pointed`)."""
    directory = Path(directory)
    pointer = directory / LATEST_FILE
    if pointer.is_file() or pointer.is_symlink():
        target = _pointed(directory, pointer)
        if is_complete(target):
            return target
        logger.warning("%s names %s, which is not a complete checkpoint; scanning instead", pointer, target)
    found = [p for p in complete_checkpoints(directory) if not p.is_symlink()]
    return found[-1] if found else None


def remove_tree(path: Path) -> None:
    """Remove directory ``path``; when it is a symbolic link (a checkpoint linked to other storage,
    or a crafted run's ``.tmp-*`` aimed anywhere) only the link: rmtree refuses one, which would stop
    every save, and nothing outside the checkpoint root is ever deleted."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def move_into_place(directory: Path, tmp: Path, final: Path) -> None:
    """Move a finished save into place and point ``latest`` at it."""
    fsync_dir(tmp)
    if final.exists():
        # Re-saving a step: move the old copy aside first; rename cannot replace a directory.
        stale = directory / f"{TMP_PREFIX}old-{final.name}"
        if stale.exists() or stale.is_symlink():
            remove_tree(stale)
        os.rename(final, stale)
        os.rename(tmp, final)
        write_pointer(directory, final.name)
        remove_tree(stale)
    else:
        os.rename(tmp, final)
        write_pointer(directory, final.name)


def delete_checkpoint(checkpoint: Path) -> None:
    """Delete a checkpoint directory; first renamed out of the ``step_*`` names, so a crash
    halfway through leaves no partial checkpoint that looks like one."""
    if checkpoint.is_symlink():  # a link to other storage: the link goes, never its target
        checkpoint.unlink()
        return
    doomed = checkpoint.with_name(f"{DELETING_PREFIX}{checkpoint.name}")
    os.rename(checkpoint, doomed)
    shutil.rmtree(doomed)


def remove_leftovers(directory: Path) -> None:
    """After a completed save: remove what crashed saves and deletions left behind (temporary
    directories, and ``step_*`` directories without their trainer state from older code)."""
    for path in directory.iterdir():
        leftover = path.name.startswith(TMP_PREFIX) or (STEP_DIR.match(path.name) and not is_complete(path))
        if leftover and (path.is_dir() or path.is_symlink()):
            logger.warning("removing %s, left by an interrupted save or deletion", path)
            remove_tree(path)


def prune(directory: Path, keep: int | None, final: Path) -> None:
    """Delete the oldest checkpoints beyond ``keep`` (None keeps all). The checkpoint just
    written (``final``) always stays, even when an older step was re-saved after newer ones
    (a run restarted from an earlier point)."""
    if keep is None:
        return
    others = [p for p in complete_checkpoints(directory) if p != final]
    for old in others[: max(0, len(others) - (keep - 1))]:
        logger.info("deleting old checkpoint %s (keep=%d)", old, keep)
        delete_checkpoint(old)
