"""Damaged and crafted checkpoints: the manifest catches damage without loading, every pickle is
read with an allow-list (nothing in a checkpoint executes), and both are one-line CheckpointErrors."""
import errno
import io
import json
import os
import pickle

import pytest
import torch
from tests.helpers.checkpoint_cases import build_sharded

from polyfsdp.backends import get_backend, init_distributed
from polyfsdp.engines import checkpoint as ckpt
from polyfsdp.engines.checkpoint.files import write_manifest
from polyfsdp.engines.checkpoint.paths import MANIFEST_FILE


@pytest.fixture(scope="module")
def mesh():
    return init_distributed(get_backend("cpu"))


@pytest.fixture()
def saved(mesh, tmp_path):
    model, opt, sched = build_sharded(mesh, seed=0)
    x = torch.arange(8).view(1, 8)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    opt.step()
    path = ckpt.save_checkpoint(tmp_path / "ck", 1, model=model, optimizer=opt, lr_scheduler=sched,
                                extra={"phase": "sft", "n": 3, "ids": [1, 2], "t": torch.ones(2)})
    return path, (model, opt, sched)


def _load(path, engine_parts):
    model, opt, sched = engine_parts
    return ckpt.load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched)


def test_manifest_lists_every_file_with_size_and_checksum(saved):
    path, parts = saved
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    on_disk = {p.name for p in path.iterdir() if p.name != MANIFEST_FILE}
    assert set(listed) == on_disk and {".metadata", "trainer_state.pt", "rng_rank0.pt"} <= on_disk
    assert all(entry["size"] == (path / name).stat().st_size for name, entry in listed.items())
    ckpt.verify_checkpoint(path)
    step, extra = _load(path, parts)
    assert step == 1 and extra["ids"] == [1, 2] and torch.equal(extra["t"], torch.ones(2))


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _flip_last_byte(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": (lambda p: _truncate(next(p.glob("*.distcp"))), "truncated or damaged"),
    "deleted .metadata": (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    "truncated trainer_state": (lambda p: _truncate(p / "trainer_state.pt"), "trainer_state.pt has"),
    "empty rng file": (lambda p: (p / "rng_rank0.pt").write_bytes(b""), "rng_rank0.pt has 0 bytes"),
    "same size, other bytes": (lambda p: _flip_last_byte(next(p.glob("*.distcp"))), "does not match its checksum"),
    "no manifest": (lambda p: (p / MANIFEST_FILE).unlink(), "no manifest.json"),
    # A manifest that vouches for nothing, with a damaged shard behind it.
    "empty manifest": (lambda p: (_flip_last_byte(next(p.glob("*.distcp"))),
                                  (p / MANIFEST_FILE).write_text(json.dumps({"files": {}}))), "does not list"),
    "unlisted extra file": (lambda p: (p / "extra.pt").write_bytes(b"x"), "does not list extra.pt"),
    "unlisted directory": (lambda p: (p / "sub").mkdir(), "does not list sub"),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_checkpoint_is_one_line_checkpoint_error_before_anything_loads(saved, damage):
    path, parts = saved
    before = {n: p.detach().clone().full_tensor() for n, p in parts[0].named_parameters()}
    harm, expected = DAMAGE[damage]
    harm(path)
    for call in (lambda: ckpt.verify_checkpoint(path), lambda: _load(path, parts)):
        with pytest.raises(ckpt.CheckpointError) as info:
            call()
        assert expected in str(info.value) and "\n" not in str(info.value)
    # Refused before loading: the live model is untouched.
    for name, param in parts[0].named_parameters():
        assert torch.equal(param.full_tensor(), before[name]), name


class _RunsCode:
    """A pickle that, when loaded without an allow-list, creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("target", ["trainer_state.pt", "rng_rank0.pt", ".metadata"])
def test_crafted_pickle_is_refused_and_nothing_executes(saved, tmp_path, target):
    path, parts = saved
    marker = tmp_path / "pwned"
    if target == ".metadata":
        (path / target).write_bytes(pickle.dumps(_RunsCode(marker)))
    else:
        torch.save({"format_version": ckpt.FORMAT_VERSION, "payload": _RunsCode(marker)}, path / target)
    write_manifest(path)  # whoever crafted it also fixed the manifest: integrity is not safety
    # Negative control: the crafted file does run code when loaded the unsafe way.
    if target != ".metadata":
        torch.load(path / target, weights_only=False)
    else:
        with open(path / target, "rb") as f:
            pickle.load(f)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(ckpt.CheckpointError, match="refused to load") as info:
        _load(path, parts)
    assert "\n" not in str(info.value)
    assert not marker.exists()


def _text(value: str) -> bytes:
    """Pickle opcode BINUNICODE: push a string."""
    data = value.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _global(module: str, name: str) -> bytes:
    """Pickle opcode STACK_GLOBAL: protocol 4 resolves a dotted ``name`` attribute by attribute."""
    return _text(module) + _text(name) + b"\x93"


def _call(function: bytes, *args: bytes) -> bytes:
    """MARK, the arguments, TUPLE, REDUCE: ``function(*args)``."""
    return function + b"(" + b"".join(args) + b"tR"


def _metadata_reaching_os_through_reexported_names(marker) -> bytes:
    """A .metadata pickle that names only torch.distributed.checkpoint.* globals, all of them classes,
    and still calls ``os.mkdir(marker)``: ``operator``'s attrgetter/itemgetter/methodcaller are classes
    re-exported by DCP's planner module, and a dataclass's ``__init__`` carries its module's globals."""
    planner, filesystem = "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.filesystem"
    module_globals = _call(_call(_global(planner, "operator.attrgetter"), _text("__init__.__globals__")),
                           _global(filesystem, "_StorageInfo"))
    os_module = _call(_call(_global(planner, "operator.itemgetter"), _text("os")), module_globals)
    mkdir = _call(_global(planner, "operator.methodcaller"), _text("mkdir"), _text(str(marker)))
    return b"\x80\x04" + _call(mkdir, os_module) + b"."


def test_metadata_reaching_a_callable_through_a_reexported_name_is_refused(saved, tmp_path):
    path, parts = saved
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(_metadata_reaching_os_through_reexported_names(marker))
    write_manifest(path)
    # Negative control: loaded the way torch loads it, the file runs code.
    with open(path / ".metadata", "rb") as f:
        pickle.load(f)
    assert marker.is_dir()
    marker.rmdir()

    with pytest.raises(ckpt.CheckpointError, match="refused to load: global torch.distributed.checkpoint.planner"
                                                   ".operator.methodcaller is not allowed") as info:
        _load(path, parts)
    assert "\n" not in str(info.value)
    assert not marker.exists()


def _point_a_shard_item_at(path, payload: bytes) -> str:
    """Append ``payload`` to a shard and point the checkpoint's first non-tensor item at it (the
    metadata itself stays legitimate); returns that item's key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    shard = path / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload), *(
        [info.transform_descriptors] if hasattr(info, "transform_descriptors") else []))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(path)
    return key


def test_crafted_non_tensor_item_in_a_shard_is_refused_and_nothing_executes(saved, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from polyfsdp.engines.checkpoint.parts import sharded_state as _sharded_state

    path, parts = saved
    marker = tmp_path / "pwned"
    key = _point_a_shard_item_at(path, pickle.dumps(_RunsCode(marker)))
    # Negative control: torch's own DCP load unpickles non-tensor items with weights_only=False.
    with pytest.raises(CheckpointException):  # "Invalid magic number": after the payload ran
        dcp.load(_sharded_state(parts[0], parts[1]), checkpoint_id=str(path))
    assert marker.exists()
    marker.unlink()

    with pytest.raises(ckpt.CheckpointError, match=f"shard item '{key}': refused to load") as info:
        _load(path, parts)
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_extra_that_weights_only_loading_cannot_read_is_refused_at_save(saved):
    path, (model, opt, sched) = saved
    with pytest.raises(TypeError, match=r"extra\['when'\] is a object"):
        ckpt.save_checkpoint(path.parent, 2, model=model, optimizer=opt, extra={"when": object()})
    assert not (path.parent / "step_000002").exists() and not (path.parent / ".tmp-step_000002").exists()


def test_numpy_rng_state_round_trips(saved):
    import numpy as np

    path, parts = saved
    np.random.seed(123)
    ckpt.save_checkpoint(path.parent, 5, model=parts[0], optimizer=parts[1], lr_scheduler=parts[2])
    expected = np.random.rand(4)
    np.random.seed(7)
    _load(path.parent / "step_000005", parts)
    assert np.array_equal(np.random.rand(4), expected)
    assert os.path.isfile(path.parent / "step_000005" / MANIFEST_FILE)


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/injected/file")


class _FillingDisk(io.RawIOBase):
    """A file on a disk that fills up: the first writes land, then every one fails."""

    def __init__(self):
        self.writes = 0

    def writable(self):
        return True

    def write(self, data):
        self.writes += 1
        if self.writes > 2:
            _disk_full()
        return len(data)


def _save_plain_on_a_filling_disk(obj, path):
    # torch.save reports the failed write as "[enforce fail ...] unexpected pos N vs M".
    torch.save(obj, _FillingDisk())


@pytest.mark.parametrize("where", ["shards", "rng file", "rng bytes", "manifest"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint_latest(saved, monkeypatch, where):
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from polyfsdp.engines.checkpoint import files as checkpoint_files

    path, (model, opt, sched) = saved
    target = {"shards": (dcp_filesystem, "_write_item", _disk_full), "rng file": (ckpt, "save_plain", _disk_full),
              "rng bytes": (ckpt, "save_plain", _save_plain_on_a_filling_disk),
              "manifest": (checkpoint_files.json, "dump", _disk_full)}[where]
    monkeypatch.setattr(*target)
    with pytest.raises(ckpt.CheckpointSaveError) as info:
        ckpt.save_checkpoint(path.parent, 2, model=model, optimizer=opt, lr_scheduler=sched)
    monkeypatch.undo()
    message = str(info.value)
    assert message == (f"cannot save checkpoint {path.parent / 'step_000002'}: No space left on device "
                       f"(/injected/file); {path} stays the latest checkpoint"), message
    assert isinstance(info.value, OSError)
    # Nothing half-written is left, and the previous checkpoint is still the one to resume.
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step_000001"]
    assert ckpt.latest_checkpoint(path.parent) == path
    ckpt.verify_checkpoint(path)


def test_the_manifest_checksums_each_shard_item_so_a_rank_hashes_only_what_it_reads(saved):
    from torch.distributed.checkpoint import FileSystemReader

    from polyfsdp.engines.checkpoint.files import check_checksums, check_manifest

    path, _ = saved
    expected = check_manifest(path)
    entry = expected["__0_0.distcp"]
    items = sorted((w.offset, w.length) for w in FileSystemReader(str(path)).read_metadata().storage_data.values()
                   if w.relative_path == "__0_0.distcp")
    assert [(start, length) for start, length, _ in entry.spans] == items  # DCP writes its items back to back
    (start, length), index = items[len(items) // 2], len(items) // 2
    assert list(entry.spans_over(start, length)) == [index]
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[start + length // 2] ^= 0xFF
    (path / "__0_0.distcp").write_bytes(bytes(data))
    # A rank reading every other item hashes them alone and finds nothing; the one reading the
    # damaged item does.
    check_checksums(path, expected, {"__0_0.distcp": set(range(len(items))) - {index}})
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0.distcp does not match its checksum \(damaged\)$"):
        check_checksums(path, expected, {"__0_0.distcp": {index}})


def test_a_manifest_without_item_checksums_is_verified_file_by_file(saved):
    # What a polyfsdp before item checksums wrote: each file's size and SHA-256 only.
    path, parts = saved
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    for entry in manifest["files"].values():
        del entry["spans"]
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    _load(path, parts)
    _flip_last_byte(next(path.glob("*.distcp")))
    with pytest.raises(ckpt.CheckpointDamaged, match=r"__0_0.distcp does not match its checksum \(damaged\)$"):
        _load(path, parts)


def test_item_checksums_that_do_not_cover_the_file_are_a_damaged_manifest(saved):
    path, parts = saved
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"]["__0_0.distcp"]["spans"].pop(0)  # the first item would go unchecked
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointDamaged, match=r"unreadable manifest \(ValueError: spans do not cover"):
        _load(path, parts)


class _ByName:
    """An object pickled as ``getattr(owner, name)``."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return (getattr, (self.owner, self.name))


def test_metadata_holding_enum_members_by_name_loads_and_other_attributes_are_refused(saved, tmp_path, monkeypatch):
    """Python 3.12 (and 3.11.0-3.11.4) pickle an enum member as ``getattr(its class, its name)``, so
    DCP's metadata written there names its memory-format member that way: it loads (it failed with
    'global builtins.getattr is not allowed'); getattr of anything but an enum's member stays
    refused, so nothing executes."""
    from pathlib import PosixPath

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from polyfsdp.engines.checkpoint.files import read_dcp_metadata

    path, parts = saved
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    with monkeypatch.context() as patch:
        patch.setattr(_MEM_FORMAT_ENCODING, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self.name)))
        by_name = pickle.dumps(metadata)
    assert b"getattr" in by_name  # the member, by name (as this Python pickles it anyway where it is 3.12)
    (path / ".metadata").write_bytes(by_name)
    write_manifest(path)
    assert read_dcp_metadata(path).state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    _load(path, parts)  # the whole load goes through
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps((_ByName(PosixPath, "unlink"), _RunsCode(marker))))
    write_manifest(path)
    with pytest.raises(ckpt.CheckpointError, match=r"refused to load: getattr\(PosixPath, 'unlink'\) is not allowed"):
        _load(path, parts)
    assert not marker.exists()


def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["shards", "rng file"])
def test_ctrl_c_during_a_save_is_an_interrupt_and_leaves_nothing_half_written(saved, monkeypatch, where):
    """DCP catches what its stages raise, KeyboardInterrupt too, and wraps it (the shards case):
    a Ctrl-C there was reported as 'cannot save checkpoint ...: KeyboardInterrupt'. Raised outside
    DCP (the rng file), it used to leave the partial save behind."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    path, (model, opt, sched) = saved
    monkeypatch.setattr(*{"shards": (dcp_filesystem, "_write_item", _ctrl_c), "rng file": (ckpt, "save_plain", _ctrl_c)}[where])
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(path.parent, 2, model=model, optimizer=opt, lr_scheduler=sched)
    monkeypatch.undo()
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step_000001"]
    assert ckpt.latest_checkpoint(path.parent) == path
    ckpt.verify_checkpoint(path)


def test_ctrl_c_during_a_load_is_an_interrupt(saved, monkeypatch):
    from polyfsdp.engines.checkpoint.files import SafeDcpReader

    path, engine_parts = saved
    monkeypatch.setattr(SafeDcpReader, "read_data", _ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        _load(path, engine_parts)
