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

A crafted directory could also aim a read outside the checkpoint: every path it names obeys
``paths.py`` (its own files only, no symbolic link), checked before anything is read.
"""
from __future__ import annotations

import bisect
import enum
import hashlib
import json
import os
import io
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .errors import CheckpointDamaged, CheckpointError
from .paths import (DCP_METADATA_FILE, MANIFEST_FILE, check_listed_name, check_shard_files, check_shard_names,
                    refuse_link)

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


def _sha256(path: Path, start: int = 0, length: int | None = None) -> str:
    """SHA-256 of ``length`` bytes of ``path`` from ``start`` (default: to the end)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = float("inf") if length is None else length
        while left > 0 and (chunk := f.read(int(min(_HASH_CHUNK, left)))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _span_cuts(directory: Path) -> dict[str, set[int]]:
    """Where each shard file's DCP items start and end (from ``.metadata``): the manifest hashes
    the bytes between two cuts as one span, so a rank hashes exactly the items it reads. A
    ``.metadata`` that does not read (a crafted one, re-hashed by whoever made it) gives none."""
    try:
        metadata = read_dcp_metadata(directory)
    except CheckpointError:
        return {}
    cuts: dict[str, set[int]] = {}
    for where in metadata.storage_data.values():
        cuts.setdefault(where.relative_path, set()).update((where.offset, where.offset + where.length))
    return cuts


def _digests(path: Path, cuts: set[int]) -> tuple[str, list[list]]:
    """One pass over ``path``: its SHA-256, and ``[start, length, sha256]`` of every span
    between consecutive ``cuts`` (0 and the size always among them)."""
    size = path.stat().st_size
    bounds = sorted({0, size} | {c for c in cuts if 0 < c < size})
    whole, spans = hashlib.sha256(), []
    with open(path, "rb") as f:
        for start, end in zip(bounds, bounds[1:]):
            span, left = hashlib.sha256(), end - start
            while left > 0 and (chunk := f.read(min(_HASH_CHUNK, left))):
                whole.update(chunk)
                span.update(chunk)
                left -= len(chunk)
            spans.append([start, end - start, span.hexdigest()])
    return whole.hexdigest(), spans


def _checkpoint_files(directory: Path) -> list[Path]:
    """Every entry of a checkpoint directory but its manifest: what the manifest must cover."""
    return [p for p in sorted(directory.iterdir()) if p.name != MANIFEST_FILE]


@dataclass(frozen=True)
class ManifestEntry:
    """What the manifest vouches for of one file: its size, SHA-256, and ``(start, length,
    sha256)`` of each span, consecutive and covering the file (a shard file: one span per DCP
    item; None in a manifest from before span checksums)."""

    size: int
    sha256: str
    spans: tuple[tuple[int, int, str], ...] | None

    def span_count(self) -> int:
        return 1 if self.spans is None else len(self.spans)

    def spans_over(self, offset: int, length: int) -> range:
        """Indices of the spans holding bytes ``[offset, offset + length)``."""
        if self.spans is None:
            return range(1)
        starts = [start for start, _, _ in self.spans]
        first = max(0, bisect.bisect_right(starts, offset) - 1)
        last = max(first, bisect.bisect_left(starts, offset + max(length, 1)) - 1)
        return range(first, last + 1)


def write_manifest(directory: Path) -> None:
    """List every file of ``directory`` (name, size, SHA-256 of the file and of each span) in its
    manifest, written and synced last. Span checksums let a rank that reads some items of a shard
    file (a resharded load, a replicated item stored once) verify just those."""
    cuts = _span_cuts(directory)
    files = {}
    for p in _checkpoint_files(directory):
        if p.is_file():
            whole, spans = _digests(p, cuts.get(p.name, set()))
            files[p.name] = {"size": p.stat().st_size, "sha256": whole, "spans": spans}
    tmp = directory / f"{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)


def _entry(entry: dict) -> ManifestEntry:
    size = int(entry["size"])
    spans = None
    if "spans" in entry:
        spans = tuple((int(start), int(length), str(sha)) for start, length, sha in entry["spans"])
        ends = [0] + [start + length for start, length, _ in spans]
        if any(start != end for (start, _, _), end in zip(spans, ends)) or ends[-1] != size:
            raise ValueError(f"spans do not cover its {size} bytes in order")
    return ManifestEntry(size, str(entry["sha256"]), spans)


def check_manifest(path: str | os.PathLike) -> dict[str, ManifestEntry]:
    """The manifest's entries once the cheap checks pass: it lists every file of the checkpoint
    (a file it does not vouch for is as untrusted as a damaged one) and each is present with its
    size. Reads no file but the manifest (one ``stat`` per file); raises
    :class:`CheckpointDamaged` naming the first problem."""
    path = Path(path)
    manifest = path / MANIFEST_FILE
    refuse_link(path, MANIFEST_FILE)
    if not manifest.is_file():
        raise CheckpointDamaged(f"{path}: no {MANIFEST_FILE} (an incomplete save, or written by a polyfsdp "
                                f"older than checkpoint manifests)")
    try:
        expected = {str(name): _entry(entry) for name, entry in json.loads(manifest.read_text())["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointDamaged(f"{manifest}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    unlisted = [p.name for p in _checkpoint_files(path) if p.name not in expected]
    if unlisted:
        raise CheckpointDamaged(f"{manifest}: does not list {unlisted[0]} ({len(unlisted)} file(s) of the checkpoint "
                                f"unlisted): damaged, or not written by polyfsdp")
    for name, entry in expected.items():
        file = path / name
        check_listed_name(manifest, name)
        refuse_link(path, name)
        if not file.is_file():
            raise CheckpointDamaged(f"{path}: {name} is missing")
        actual = file.stat().st_size
        if actual != entry.size:
            raise CheckpointDamaged(f"{path}: {name} has {actual} bytes, the manifest says {entry.size} "
                                    f"(truncated or damaged)")
    return expected


# Which spans of a file to hash: a set of span indices, or ALL_SPANS (the whole file).
ALL_SPANS = None


def check_checksums(path: str | os.PathLike, expected: dict[str, ManifestEntry], wanted: dict) -> None:
    """Hash, of each file named in ``wanted`` (in the manifest's order), the spans it maps to
    (``ALL_SPANS``: the whole file; so too for a manifest without span checksums) against
    ``expected`` (:func:`check_manifest`); a mismatch is :class:`CheckpointDamaged`."""
    path = Path(path)
    for name, entry in expected.items():
        if name not in wanted:
            continue
        spans = wanted[name]
        if spans is ALL_SPANS or entry.spans is None:
            good = _sha256(path / name) == entry.sha256
        else:
            good = all(_sha256(path / name, entry.spans[i][0], entry.spans[i][1]) == entry.spans[i][2]
                       for i in sorted(spans))
        if not good:
            raise CheckpointDamaged(f"{path}: {name} does not match its checksum (damaged)")


def unread_spans(expected: dict[str, ManifestEntry], reads: list[dict]) -> dict[str, set[int]]:
    """The spans of each file of ``expected`` that none of ``reads`` (every rank's ``{name:
    spans or ALL_SPANS}``) covers: what rank 0 hashes besides its own."""
    left = {}
    for name, entry in expected.items():
        covered = [read[name] for read in reads if name in read]
        if ALL_SPANS in covered:
            continue
        spans = set(range(entry.span_count())) - set().union(*covered)
        if spans:
            left[name] = spans
    return left


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointDamaged` naming the first problem unless the manifest lists every
    file of the checkpoint and each is present with its size and checksum (hashes every file:
    a load hashes only what each rank reads, ``checkpoint.load_checkpoint``); a
    :class:`CheckpointError` when a path it names leaves the checkpoint (a symbolic link, a shard
    file of ``.metadata`` that is not one the manifest lists)."""
    path = Path(path)
    expected = check_manifest(path)
    check_checksums(path, expected, dict.fromkeys(expected, ALL_SPANS))
    check_shard_files(path, read_dcp_metadata(path), expected)


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


def _enum_member(cls, name: str):
    """What ``getattr(cls, name)`` gives in a DCP metadata pickle, for an enum member only: Python
    3.12 (and 3.11.0-3.11.4) pickle an enum member as ``getattr(its class, its name)``, so
    ``_MEM_FORMAT_ENCODING``'s members arrive that way; any other attribute is refused (``cls``
    itself came through the allow-list)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not "
                                 f"allowed (only an enum's members)")


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
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
            metadata = _DcpMetadataUnpickler(f).load()
        check_shard_names(file, metadata)
        return metadata
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {DCP_METADATA_FILE} is missing") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{file}: refused to load: {_one_line(exc)}") from None
    except Exception as exc:
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__}: {_one_line(exc)})") from None


class SafeDcpReader(FileSystemReader):
    """torch's filesystem reader, with ``.metadata`` read through the allow-list and shard files
    only ever read from the checkpoint itself."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = read_dcp_metadata(Path(self.path))
        # What torch's own read_metadata adds after unpickling (the load id of this read).
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def set_up_storage_reader(self, metadata, *args: Any, **kwargs: Any) -> None:
        # Every rank reads with the metadata the coordinator read (and checked) and broadcast:
        # checked again here, where the shard names it reads from are taken.
        check_shard_names(Path(self.path) / DCP_METADATA_FILE, metadata)
        super().set_up_storage_reader(metadata, *args, **kwargs)


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


def dcp_spans_read(state: dict, metadata, expected: dict[str, ManifestEntry]) -> dict[str, set[int]]:
    """The manifest spans of each shard file that a ``dcp.load`` of ``state`` (this rank's state
    dict) reads, by the plan torch's load planner makes for it against ``metadata``
    (:func:`read_dcp_metadata`): on another world size a rank's rows span items of several saved
    files, and a replicated item (an optimizer step count) DCP stored once sits in one of them.
    Every shard file must be one the manifest lists (:func:`check_shard_files`, called first)."""
    planner = SafeDcpLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    spans: dict[str, set[int]] = {}
    for item in planner.create_local_plan().items:
        where = metadata.storage_data[item.storage_index]
        entry = expected[where.relative_path]
        spans.setdefault(where.relative_path, set()).update(entry.spans_over(where.offset, where.length))
    return spans
