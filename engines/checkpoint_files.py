"""What makes a checkpoint directory trustworthy: its manifest and safe loading of its files.

A checkpoint's ``manifest.json`` is written last (before the directory is renamed into
place) and lists every other file with its size and SHA-256, so "complete and intact" is
checkable without loading anything (:func:`verify_checkpoint`). A checkpoint may come from
someone else, and a manifest only proves integrity, not intent: every pickle is therefore
read with an allow-list (``torch.load(weights_only=True)`` for our files, :func:`check_dcp_metadata`
for ``torch.distributed.checkpoint``'s ``.metadata``, which torch reads with plain ``pickle``).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

MANIFEST_FILE = "manifest.json"
DCP_METADATA_FILE = ".metadata"
_HASH_CHUNK = 1 << 20
# The packages whose classes a DCP .metadata pickle may name (dataclasses and enums only).
_DCP_MODULE_PREFIX = "torch.distributed.checkpoint."
# Besides those: tensor sizes, dtypes and layouts, and the checkpoint's path (storage metadata).
_DCP_OTHER_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                      ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or not safe to load (one-line message)."""


class CheckpointSaveError(CheckpointError, OSError):
    """A save that failed (a full disk, an unwritable directory) on some rank; raised on every
    rank, after the partial save is removed. Also an OSError: it is one."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """List every file of ``directory`` (name, size, SHA-256) in its manifest, written and synced last."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST_FILE}
    tmp = directory / f"{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming the first problem unless every file the manifest
    lists is present with its size and checksum."""
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_FILE} (an incomplete save, or written by a polyfsdp "
                              f"older than checkpoint manifests)")
    try:
        files = json.loads(manifest.read_text())["files"]
        expected = {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{manifest}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    for name, (size, sha256) in expected.items():
        file = path / name
        if Path(name).name != name:
            raise CheckpointError(f"{manifest}: lists {name!r}, which is not a file name")
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{path}: {name} has {actual} bytes, the manifest says {size} (truncated or damaged)")
        if _sha256(file) != sha256:
            raise CheckpointError(f"{path}: {name} does not match its checksum (damaged)")


def remove_path(path: Path) -> None:
    """Remove the file, directory or symbolic link at ``path``: a link itself, never its
    target (a user may link a checkpoint or an export to other storage). Absent: nothing."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def save_plain(obj: Any, path: Path) -> None:
    """``torch.save`` of tensors and plain types, synced to disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def load_plain(path: Path) -> Any:
    """Load a file :func:`save_plain` wrote: tensors and plain types only, nothing executes."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused to load: it holds more than tensors and plain types "
                              f"(a crafted file, or one written by an older polyfsdp): {first}") from None
    except Exception as exc:  # a truncated or foreign file: torch raises several types
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {' '.join(str(exc).split())})") from None


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_OTHER_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_DCP_MODULE_PREFIX):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a class (dataclass or enum), never a function
                return found
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def check_dcp_metadata(path: Path) -> None:
    """Unpickle DCP's ``.metadata`` with an allow-list first: torch reads it with plain
    ``pickle``, which would run whatever a crafted file asks for."""
    file = path / DCP_METADATA_FILE
    try:
        with open(file, "rb") as f:
            _DcpMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {DCP_METADATA_FILE} is missing") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{file}: refused to load: {' '.join(str(exc).split())}") from None
    except Exception as exc:
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__}: {' '.join(str(exc).split())})") from None
