"""Which paths a checkpoint may name: only its own files, never through a symbolic link.

A checkpoint directory may come from someone else, and a manifest only proves that its files are
the ones whoever wrote it hashed. A crafted directory could still aim a read elsewhere without
any pickle running: a ``.metadata`` whose shard paths are absolute or ``../..`` (torch joins them
to the checkpoint's path), a manifest naming such a path, a file that is a symbolic link. So every
name a checkpoint holds is a plain file name of the checkpoint itself, none of its files is a
link, and every shard file DCP would read is one the manifest lists (and so hashes). The pointer
``latest`` obeys the same rule in its phase directory (``layout.py``).
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError

MANIFEST_FILE = "manifest.json"
DCP_METADATA_FILE = ".metadata"
_OWN_FILES_ONLY = "a checkpoint reads only its own files"


def is_plain_name(name) -> bool:
    """Whether ``name`` names an entry of a directory itself: a string without a path separator,
    not ``.`` or ``..`` (what an absolute or ``../..`` path, written into a crafted file, is not)."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in ("/", "\\", "\0"))


def refuse_link(path: Path, name: str) -> None:
    """Refuse file ``name`` of checkpoint ``path`` if it is a symbolic link: reading it would read
    whatever it points at, inside the checkpoint or not (its target's checksum vouches for nothing)."""
    file = path / name
    if file.is_symlink():
        raise CheckpointError(f"{file}: a symbolic link (to {os.readlink(file)}); refused: {_OWN_FILES_ONLY}")


def check_listed_name(manifest: Path, name: str) -> None:
    """Refuse a manifest entry that is not a plain file name of the checkpoint."""
    if not is_plain_name(name):
        raise CheckpointError(f"{manifest}: lists {name!r}, which is not a file of this checkpoint "
                              f"(refused: {_OWN_FILES_ONLY})")


def check_shard_names(file: Path, metadata) -> None:
    """Refuse a DCP ``metadata`` (read from ``file``) that names a shard file other than a plain
    file name of its checkpoint: an absolute or ``../..`` one would read a file outside it."""
    for where in metadata.storage_data.values():
        name = getattr(where, "relative_path", None)
        if not is_plain_name(name):
            raise CheckpointError(f"{file}: names the shard file {name!r}, which is not a file of this checkpoint "
                                  f"(refused: {_OWN_FILES_ONLY})")


def check_shard_files(path: Path, metadata, listed) -> None:
    """Refuse a DCP ``metadata`` of checkpoint ``path`` that names a shard file its manifest does
    not list (``listed``: the manifest's names): its bytes would be read unhashed."""
    for where in metadata.storage_data.values():
        if where.relative_path not in listed:
            raise CheckpointError(f"{path / DCP_METADATA_FILE}: names the shard file {where.relative_path!r}, which "
                                  f"{MANIFEST_FILE} does not list (refused: every file read must be checksummed)")
