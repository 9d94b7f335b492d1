"""What makes a checkpoint directory trustworthy: its manifest and safe loading of its files.

A checkpoint's ``manifest.json`` is written last (before the directory is renamed into
place) and lists every other file with its size and SHA-256, so "complete and intact" is
checkable without loading anything (:func:`verify_checkpoint`). A checkpoint may come from
someone else, and a manifest only proves integrity, not intent (whoever crafts a file can
re-hash it): every pickle is therefore read with an allow-list. Our own files go through
``torch.load(weights_only=True)``. ``torch.distributed.checkpoint`` reads two kinds of pickle
unsafely: its ``.metadata`` (plain ``pickle.load``) and the non-tensor items inside its ``.distcp``
shards (``torch.load(weights_only=False)``); :class:`SafeDcpReader` and :class:`SafeDcpLoadPlanner`
replace both reads. The metadata allow-list names exact classes, never a module prefix: DCP's
modules re-export standard-library callables (``operator.attrgetter`` and friends are classes), and
a protocol-4 pickle reaches them through dotted names.
"""
from __future__ import annotations

import hashlib
import json
import os
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

MANIFEST_FILE = "manifest.json"
DCP_METADATA_FILE = ".metadata"
_HASH_CHUNK = 1 << 20
# The exact globals a DCP .metadata pickle may name: the dataclasses and enum DCP's Metadata is
# made of, tensor sizes and layouts, and the checkpoint's path (storage metadata); dtypes besides.
# Names a torch release lacks are simply not allowed.
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),
    "pathlib": ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or not safe to load (one-line message)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not match its manifest (missing, truncated, altered, unlisted):
    ``trainer.resume=auto`` skips it for an older one."""


class CheckpointSaveError(CheckpointError, OSError):
    """A save that failed (a full disk, an unwritable directory) on some rank; raised on every
    rank, after the partial save is removed. Also an OSError: it is one."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _checkpoint_files(directory: Path) -> list[Path]:
    """Every entry of a checkpoint directory but its manifest: what the manifest must cover."""
    return [p for p in sorted(directory.iterdir()) if p.name != MANIFEST_FILE]


def write_manifest(directory: Path) -> None:
    """List every file of ``directory`` (name, size, SHA-256) in its manifest, written and synced last."""
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _checkpoint_files(directory) if p.is_file()}
    tmp = directory / f"{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)


def check_manifest(path: str | os.PathLike) -> dict[str, tuple[int, str]]:
    """The manifest's ``{name: (size, sha256)}`` once the cheap checks pass: it lists every file
    of the checkpoint (a file it does not vouch for is as untrusted as a damaged one) and each is
    present with its size. Reads no file but the manifest (one ``stat`` per file); raises
    :class:`CheckpointDamaged` naming the first problem."""
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise CheckpointDamaged(f"{path}: no {MANIFEST_FILE} (an incomplete save, or written by a polyfsdp "
                                f"older than checkpoint manifests)")
    try:
        files = json.loads(manifest.read_text())["files"]
        expected = {str(name): (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointDamaged(f"{manifest}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    unlisted = [p.name for p in _checkpoint_files(path) if p.name not in expected]
    if unlisted:
        raise CheckpointDamaged(f"{manifest}: does not list {unlisted[0]} ({len(unlisted)} file(s) of the checkpoint "
                                f"unlisted): damaged, or not written by polyfsdp")
    for name, (size, _) in expected.items():
        file = path / name
        if Path(name).name != name:
            raise CheckpointDamaged(f"{manifest}: lists {name!r}, which is not a file name")
        if not file.is_file():
            raise CheckpointDamaged(f"{path}: {name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointDamaged(f"{path}: {name} has {actual} bytes, the manifest says {size} "
                                    f"(truncated or damaged)")
    return expected


def check_checksums(path: str | os.PathLike, expected: dict[str, tuple[int, str]], names) -> None:
    """Hash the files ``names`` of checkpoint ``path`` (in the manifest's order) against
    ``expected`` (:func:`check_manifest`); a mismatch is :class:`CheckpointDamaged`."""
    path, wanted = Path(path), set(names)
    for name, (_, sha256) in expected.items():
        if name in wanted and _sha256(path / name) != sha256:
            raise CheckpointDamaged(f"{path}: {name} does not match its checksum (damaged)")


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointDamaged` naming the first problem unless the manifest lists every
    file of the checkpoint and each is present with its size and checksum (hashes every file:
    a load hashes only what each rank reads, ``checkpoint.load_checkpoint``)."""
    expected = check_manifest(path)
    check_checksums(path, expected, expected)


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
        # A dotted name walks attributes from an allowed module to anything it imports: refused.
        if "." not in name:
            if name in _DCP_METADATA_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def read_dcp_metadata(path: Path):
    """DCP's ``.metadata`` of checkpoint ``path``, unpickled through the allow-list (torch itself
    reads it with plain ``pickle``, which would run whatever a crafted file asks for)."""
    file = path / DCP_METADATA_FILE
    try:
        with open(file, "rb") as f:
            return _DcpMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {DCP_METADATA_FILE} is missing") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{file}: refused to load: {_one_line(exc)}") from None
    except Exception as exc:
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__}: {_one_line(exc)})") from None


class SafeDcpReader(FileSystemReader):
    """torch's filesystem reader, with ``.metadata`` read through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = read_dcp_metadata(Path(self.path))
        # What torch's own read_metadata adds after unpickling (the load id of this read).
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeDcpLoadPlanner(DefaultLoadPlanner):
    """torch's load planner, with the shards' non-tensor items (optimizer hyper-parameters, ...)
    read by ``torch.load(weights_only=True)`` instead of torch's ``weights_only=False``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"shard item {read_item.dest_index.fqn!r}: refused to load: it holds more than "
                                  f"tensors and plain types: {_one_line(exc).split('. ')[0]}") from None
        # Hand torch's own bookkeeping (flattened keys, nested placement) the value re-serialized
        # from what was loaded safely: what it unpickles is then ours, not the file's.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def dcp_files_read(state: dict, metadata) -> set[str]:
    """The shard files a ``dcp.load`` of ``state`` (this rank's state dict) reads, by the plan
    torch's load planner makes for it against ``metadata`` (:func:`read_dcp_metadata`): on
    another world size a rank's shard spans parts of several saved files."""
    planner = SafeDcpLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}
