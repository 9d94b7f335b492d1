"""Sharded training checkpoints that a killed run resumes from exactly, and Hugging Face export.

Layout of ``directory``::

    step_000120/            a complete checkpoint (only ever created by an atomic rename)
        .metadata, *.distcp model + optimizer shards (torch.distributed.checkpoint), and those
                            of every named part (a PPO run's critic) under ``parts.<name>.``
        trainer_state.pt    step, extra, scheduler states, the parts' names, world size  (rank 0)
        rng_rank{r}.pt      RNG states of rank r
        manifest.json       every other file's size and SHA-256 (and each DCP item's), written last (rank 0)
    .tmp-step_000130/       a save in progress (or one that crashed): never read
    .tmp-del-step_000110/   an old checkpoint being deleted (or whose deletion crashed): never read
    latest                  text file naming the newest complete checkpoint

A checkpoint is one unit: the engine's own model and optimizer plus any named *parts*
(:class:`CheckpointPart`: other models trained in the same run, like PPO's critic) share one
directory, one manifest and one ``latest``, and are kept or deleted together, so no crash can
leave one part at a step the others lack.

A save writes everything into the temporary directory, waits for every rank, then rank 0
renames it into place and replaces ``latest`` atomically (temp file + ``os.replace``); older
checkpoints beyond ``keep`` are deleted only after that, each renamed out of the ``step_*``
names first. So a crash at any point leaves ``latest`` naming a complete checkpoint; so too
for a save finishing in the background (``background=True``), whose commit waits for the write. Loading
checks the manifest and reads every pickle with an allow-list (``checkpoint_files.py``): a
damaged or crafted checkpoint is a :class:`CheckpointError`, and nothing in it executes.
"""
from __future__ import annotations

import copy
import logging
import os
import random
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from polyfsdp.backends.distributed import (all_gather_object, all_gather_object_in, background_group, barrier,
                                           current_rank, current_world_size)

from .checkpoint_files import (ALL_SPANS, DCP_METADATA_FILE, CheckpointDamaged, CheckpointError, CheckpointSaveError,
                               SafeDcpLoadPlanner, SafeDcpReader, check_checksums, check_manifest, dcp_spans_read,
                               load_plain, read_dcp_metadata, save_plain, unread_spans, verify_checkpoint,
                               write_manifest)

__all__ = ["CheckpointDamaged", "CheckpointError", "CheckpointPart", "PendingCheckpoint", "CheckpointSaveError", "checkpoint_parts", "complete_checkpoints",
           "export_hf", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "step_dir_name", "verify_checkpoint",
           "wait_for_background_save"]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = f"{TMP_PREFIX}del-"  # an old checkpoint renamed out of the way before it is deleted
TRAINER_STATE_FILE = "trainer_state.pt"
# 2: RNG and trainer state hold only tensors and plain types (weights-only loading), manifest.json.
FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")


# --------------------------------------------------------------------------- helpers


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of ``step`` (``step_000123``)."""
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    # Makes a rename/replace durable across power loss, not just process death.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_pointer(directory: Path, name: str) -> None:
    tmp = directory / f"{LATEST_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST_FILE)
    _fsync_dir(directory)


def _is_complete(path: Path) -> bool:
    return path.is_dir() and _STEP_DIR.match(path.name) is not None and (path / TRAINER_STATE_FILE).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest step first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or the newest complete one if the pointer is missing
    or stale; None when there is none. Temporary (in-progress or crashed) saves are ignored."""
    directory = Path(directory)
    pointer = directory / LATEST_FILE
    if pointer.is_file():
        target = directory / pointer.read_text().strip()
        if _is_complete(target):
            return target
        logger.warning("%s names %s, which is not a complete checkpoint; scanning instead", pointer, target)
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def _rng_state(backend) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        # numpy's state holds an ndarray, which weights-only loading refuses: keep it as a tensor.
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"bit_generator": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if backend is not None:
        state["backend"] = backend.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any], backend) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            logger.warning("checkpoint holds a numpy RNG state but numpy is not installed; skipped")
        else:
            saved = state["numpy"]
            np.random.set_state((saved["bit_generator"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                                 saved["has_gauss"], saved["cached_gaussian"]))
    if backend is not None and "backend" in state:
        backend.set_rng_state(state["backend"])


_PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor)


def _check_plain(value: Any, where: str) -> None:
    """``extra`` is loaded weights-only: refuse at save time what could not be loaded back."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; checkpoint extra keys are str or int")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN_TYPES):
        raise TypeError(f"{where} is a {type(value).__name__}; checkpoint extra holds tensors, str, int, float, bool, "
                        f"None and lists/tuples/dicts of them")


# Only what is trained is saved: frozen parameters (a LoRA run's base model) are rebuilt
# from the model config, so they never change and need no copy in every checkpoint.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
# Loading sets the trained keys only; dcp.load has already refused a checkpoint lacking any of them.
_LOAD_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def _sharded_state(model, optimizer) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_TRAINED_ONLY)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
    return {"model": model_sd, "optim": optim_sd}


@dataclass
class CheckpointPart:
    """One trained model of a checkpoint: its (sharded) module, optimizer and scheduler.

    The engine itself is the checkpoint's main part; a run that trains more models (PPO's
    critic) names each as a part of the same checkpoint, saved and loaded with it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None

    def saved_state(self) -> dict[str, Any]:
        """Model (+ optimizer) state for DCP. get_state_dict() initialises an empty optimizer
        state with a zero-lr step, which would advance Adam's step count of the live run: an
        optimizer that has not stepped yet is left out (and cleared on load) instead."""
        optimizer = self.optimizer if self.optimizer is not None and self.optimizer.state else None
        return _sharded_state(self.model, optimizer)

    def saved_info(self, state: dict[str, Any]) -> dict[str, Any]:
        """What trainer_state.pt records of this part besides its shards."""
        return {"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "has_optimizer_state": "optim" in state}

    def state_to_load(self, info: dict[str, Any], where: Path) -> dict[str, Any]:
        """The state dict DCP fills in for this part, given what the checkpoint recorded of it."""
        if self.lr_scheduler is not None and info["lr_scheduler"] is None:
            raise ValueError(f"{where}: checkpoint has no scheduler state but load_checkpoint was given "
                             f"lr_scheduler={self.lr_scheduler!r}; pass lr_scheduler=None")
        load_optim = self.optimizer is not None and info["has_optimizer_state"]
        if self.optimizer is not None and not load_optim:
            self.optimizer.state.clear()  # saved before the first optimizer step
        return _sharded_state(self.model, self.optimizer if load_optim else None)

    def restore(self, state: dict[str, Any], info: dict[str, Any]) -> None:
        """Set the model, optimizer and scheduler from the state DCP loaded."""
        if "optim" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=_LOAD_TRAINED_ONLY)
        else:
            set_model_state_dict(self.model, state["model"], options=_LOAD_TRAINED_ONLY)
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(info["lr_scheduler"])
            if self.optimizer is not None:
                # A scheduler's state does not include the optimizer's current lr.
                for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                    group["lr"] = lr


_PART_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_parts(parts: dict | None) -> dict[str, CheckpointPart]:
    parts = dict(parts or {})
    for name, part in parts.items():
        if not isinstance(name, str) or not _PART_NAME.match(name):
            raise ValueError(f"checkpoint part names are identifiers, got {name!r}")
        if not isinstance(part, CheckpointPart):
            raise TypeError(f"checkpoint part {name!r}: expected a CheckpointPart, got {type(part).__name__}")
    return parts


# --------------------------------------------------------------------------- save / load


class PendingCheckpoint:
    """A save finishing on a background thread (``save_checkpoint(background=True)``): its shards,
    the manifest, the rename into place and ``latest``. ``wait()`` returns the checkpoint's path
    or raises the save's one-line :class:`CheckpointSaveError` (on every rank alike)."""

    def __init__(self, final: Path, finish) -> None:
        self.path = final
        self._error: BaseException | None = None

        def run() -> None:
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 - handed to wait()
                self._error = exc

        # A daemon: a process that ends without waiting leaves a .tmp- directory, never a checkpoint.
        self._thread = threading.Thread(target=run, name=f"polyfsdp-save-{final.name}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def failed(self) -> bool:
        """Whether it finished with an error (which ``wait()`` raises)."""
        return self.done() and self._error is not None

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path


# The background save in flight (one at most): a save or load first waits for it.
_pending: list[PendingCheckpoint] = []


def wait_for_background_save() -> Path | None:
    """Wait for the background save in flight, if any; its path (None when there was none)."""
    if not _pending:
        return None
    return _pending.pop().wait()


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler=None,
    backend=None,
    extra: dict | None = None,
    keep: int | None = None,
    parts: dict[str, CheckpointPart] | None = None,
    background: bool = False,
) -> Path | PendingCheckpoint:
    """Save model and optimizer shards, scheduler, RNG states, ``step`` and ``extra``, and
    every named part of ``parts`` (its model, optimizer and scheduler), as one checkpoint.

    Collective: every rank calls it. Returns the final checkpoint path. ``keep`` keeps this
    checkpoint and the K-1 highest-step others (None keeps all); deletion happens only after
    this one is in place. ``background``: returns a :class:`PendingCheckpoint` as soon as the
    shards are copied to host memory (DCP's ``async_save`` staging) and the small files are
    written; the shards are written, then the manifest, the rename and ``latest``, on a thread
    whose collectives run on a process group of their own (the caller keeps training).
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive int or None, got {keep!r}")
    _check_plain(extra, "extra")
    wait_for_background_save()
    main = CheckpointPart(model, optimizer, lr_scheduler)
    parts = _check_parts(parts)
    directory = Path(directory)
    rank = current_rank()
    name = step_dir_name(step)
    tmp = directory / f"{TMP_PREFIX}{name}"
    final = directory / name
    def prepare() -> None:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                logger.warning("removing leftover %s from an interrupted save", tmp)
                shutil.rmtree(tmp)
            tmp.mkdir()

    def sharded_states() -> tuple[dict, dict, dict]:
        state = main.saved_state()
        part_states = {part_name: part.saved_state() for part_name, part in parts.items()}
        # One DCP save for all parts: one .metadata, and a part's shards are never apart from the rest.
        return state, ({**state, "parts": part_states} if parts else state), part_states

    def write_small_files(state: dict, part_states: dict) -> None:
        save_plain(_rng_state(backend), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            main_info = main.saved_info(state)
            trainer_state = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "extra": extra,
                "lr_scheduler": main_info["lr_scheduler"],
                "world_size": current_world_size(),
                "has_optimizer_state": main_info["has_optimizer_state"],
                "parts": {part_name: part.saved_info(part_states[part_name]) for part_name, part in parts.items()},
            }
            save_plain(trainer_state, tmp / TRAINER_STATE_FILE)

    def write() -> None:
        state, whole, part_states = sharded_states()
        dcp.save(whole, checkpoint_id=str(tmp))
        write_small_files(state, part_states)

    def commit() -> None:
        if rank == 0:
            write_manifest(tmp)  # last: every rank's files are in place
            _commit(directory, tmp, final)

    def finish(group=None) -> None:
        if rank == 0:
            _remove_leftovers(directory)
            if keep is not None:
                # The checkpoint just written always stays, even when an older step was re-saved
                # after newer ones (a run restarted from an earlier point).
                others = [p for p in complete_checkpoints(directory) if p != final]
                for old in others[: max(0, len(others) - (keep - 1))]:
                    logger.info("deleting old checkpoint %s (keep=%d)", old, keep)
                    _delete(old)
            logger.info("saved checkpoint %s", final)
        barrier(group)

    # Each stage ends with every rank learning whether any rank failed, so a full disk or an
    # unwritable directory on one rank stops all of them (nobody waits in the next collective).
    if not background:
        for stage in (prepare, write, commit):
            _all_ranks_or_raise(stage, directory, tmp, final)
        finish()
        return final

    group = background_group()
    upload = []

    def stage() -> None:
        state, whole, part_states = sharded_states()
        write_small_files(state, part_states)
        # Copies every shard to host memory now; the write runs on DCP's thread.
        upload.append(dcp.async_save(whole, checkpoint_id=str(tmp), process_group=group))

    for step_stage in (prepare, stage):
        _all_ranks_or_raise(step_stage, directory, tmp, final)

    def in_background() -> None:
        for later in (lambda: upload[0].result(), commit):
            _all_ranks_or_raise(later, directory, tmp, final, group)
        finish(group)

    _pending.append(PendingCheckpoint(final, in_background))
    return _pending[-1]


def _delete(checkpoint: Path) -> None:
    """Delete a checkpoint directory; first renamed out of the ``step_*`` names, so a crash
    halfway through leaves no partial checkpoint that looks like one."""
    if checkpoint.is_symlink():  # a link to other storage: the link goes, never its target
        checkpoint.unlink()
        return
    doomed = checkpoint.with_name(f"{DELETING_PREFIX}{checkpoint.name}")
    os.rename(checkpoint, doomed)
    shutil.rmtree(doomed)


def _remove_leftovers(directory: Path) -> None:
    """After a completed save: remove what crashed saves and deletions left behind (temporary
    directories, and ``step_*`` directories without their trainer state from older code)."""
    for path in directory.iterdir():
        leftover = path.name.startswith(TMP_PREFIX) or (_STEP_DIR.match(path.name) and not _is_complete(path))
        if leftover and path.is_dir():
            logger.warning("removing %s, left by an interrupted save or deletion", path)
            shutil.rmtree(path)


def _all_ranks_or_raise(stage, directory: Path, tmp: Path, final: Path, group=None) -> None:
    """Run ``stage`` on this rank; if it failed on any rank, remove the partial save and raise
    the same one-line :class:`CheckpointSaveError` on every rank. ``latest`` is untouched.
    ``group``: the process group of the verdict (a background save's own)."""
    failure = None
    try:
        stage()
    except (OSError, CheckpointException) as exc:
        failure = _failure_text(exc)
    except RuntimeError as exc:
        # torch.save's zip writer reports a failed write as "unexpected pos N vs M", with the
        # OSError as the context; any other RuntimeError is not a save failure.
        if _os_error_in(exc) is None:
            raise
        failure = _failure_text(exc)
    gathered = all_gather_object(failure) if group is None else all_gather_object_in(failure, group)
    failures = [f for f in gathered if f is not None]
    if not failures:
        return
    if current_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(group)
    kept = latest_checkpoint(directory)
    raise CheckpointSaveError(f"cannot save checkpoint {final}: {failures[0]}; "
                          f"{f'{kept} stays the latest checkpoint' if kept else 'there is no earlier checkpoint'}")


def _failure_text(exc: BaseException) -> str:
    exc = _first_cause(exc)
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


def _first_cause(exc: BaseException) -> BaseException:
    """DCP wraps each rank's error (with a traceback) in a CheckpointException: the first cause."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return next(iter(exc.failures.values()))[0]
    return exc


def _dcp_load(state: dict, path: Path) -> None:
    """``dcp.load`` with every pickle in the checkpoint read through an allow-list; a refusal
    (raised on whichever rank read the item, gathered by DCP onto all) is the one-line error."""
    try:
        dcp.load(state, storage_reader=SafeDcpReader(str(path)), planner=SafeDcpLoadPlanner())
    except CheckpointException as exc:
        cause = _first_cause(exc)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(f"{path}: {cause}") from None
        raise


def _commit(directory: Path, tmp: Path, final: Path) -> None:
    """Move a finished save into place and point ``latest`` at it."""
    _fsync_dir(tmp)
    if final.exists():
        # Re-saving a step: move the old copy aside first; rename cannot replace a directory.
        stale = directory / f"{TMP_PREFIX}old-{final.name}"
        if stale.exists():
            shutil.rmtree(stale)
        os.rename(final, stale)
        os.rename(tmp, final)
        _write_pointer(directory, final.name)
        shutil.rmtree(stale)
    else:
        os.rename(tmp, final)
        _write_pointer(directory, final.name)


def checkpoint_parts(path: str | os.PathLike) -> list[str]:
    """Names of the parts checkpoint ``path`` holds besides its main one (reads only its
    trainer state, weights-only; a damaged one is a :class:`CheckpointError`)."""
    state = load_plain(Path(path) / TRAINER_STATE_FILE)
    return sorted(state.get("parts") or {}) if isinstance(state, dict) else []


def load_checkpoint(
    directory: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler=None,
    backend=None,
    parts: dict[str, CheckpointPart] | None = None,
) -> tuple[int, dict | None]:
    """Restore what :func:`save_checkpoint` wrote, with the named ``parts`` (each must be in
    the checkpoint; parts it holds beyond those are not loaded); returns ``(step, extra)``.

    ``directory`` is a checkpoint root (its latest complete checkpoint is used) or one
    ``step_*`` directory. Collective: every rank calls it, on any world size: DCP reshards the
    model and optimizer to this one. Before anything loads, every rank checks the manifest's
    list and sizes and hashes what it reads (``.metadata``, ``trainer_state.pt``, its RNG file,
    the items of the shard files its load plan reads); rank 0 also hashes what no rank reads. A
    problem anywhere is one :class:`CheckpointError` (:class:`CheckpointDamaged` for damage) on
    every rank. RNG states are restored only on the world size that saved them (a rank of
    another world has no stream of its own in the checkpoint: every rank keeps its generators).
    """
    wait_for_background_save()
    path = Path(directory)
    if not _is_complete(path):
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint in {path} (expected step_* directories or a 'latest' file)")
        path = found
    main = CheckpointPart(model, optimizer, lr_scheduler)
    parts = _check_parts(parts)
    rank, world = current_rank(), current_world_size()
    expected, mine, shards, failure = {}, {}, {}, None
    try:
        expected = check_manifest(path)  # every rank: one stat per file
        # Hashed before any of them is read; every rank reads these.
        mine = dict.fromkeys([DCP_METADATA_FILE, TRAINER_STATE_FILE], ALL_SPANS)
        check_checksums(path, expected, mine)
        trainer_state = load_plain(path / TRAINER_STATE_FILE)
        version = trainer_state.get("format_version") if isinstance(trainer_state, dict) else None
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format_version {version!r}, this code reads {FORMAT_VERSION}")
        saved_parts = trainer_state.get("parts") or {}
        missing = sorted(set(parts) - set(saved_parts))
        if missing:
            raise CheckpointError(f"{path}: holds no part {', '.join(missing)} (its parts: "
                                  f"{', '.join(sorted(saved_parts)) or 'none'})")
        # RNG streams belong to ranks of the world that saved them: restored only on the same world size.
        same_world = trainer_state["world_size"] == world
        rng_file = f"rng_rank{rank}.pt"
        if same_world:
            if rng_file not in expected:
                raise CheckpointDamaged(f"{path}: {rng_file} is missing (saved on {world} ranks)")
            check_checksums(path, expected, {rng_file: ALL_SPANS})
            mine[rng_file] = ALL_SPANS
        state = main.state_to_load(trainer_state, path)
        part_states = {name: part.state_to_load(saved_parts[name], path) for name, part in parts.items()}
        full_state = {**state, "parts": part_states} if parts else state
        shards = dcp_spans_read(full_state, read_dcp_metadata(path), expected)
    except CheckpointError as exc:
        failure = (str(exc), isinstance(exc, CheckpointDamaged))
    # One verdict for all ranks: each hashes the items of the shard files it reads, rank 0 also
    # what no rank reads (the RNG files of ranks this world lacks).
    gathered = all_gather_object(({**mine, **shards} if failure is None else {}, failure))
    failure = next((f for _, f in gathered if f is not None), None)
    if failure is None:
        todo = dict(shards)
        if rank == 0:
            for name, spans in unread_spans(expected, [read for read, _ in gathered]).items():
                todo[name] = todo.get(name, set()) | spans
        try:
            check_checksums(path, expected, todo)
        except CheckpointDamaged as exc:
            failure = (str(exc), True)
        failure = next((f for f in all_gather_object(failure) if f is not None), None)
    if failure is not None:
        message, damaged = failure
        raise (CheckpointDamaged if damaged else CheckpointError)(message)

    _dcp_load(full_state, path)
    main.restore(state, trainer_state)
    for name, part in parts.items():
        part.restore(part_states[name], saved_parts[name])
    if same_world:
        _set_rng_state(load_plain(path / rng_file), backend)
    elif rank == 0:
        logger.info("%s was saved on %d ranks, this run has %d: RNG states are not restored (each rank keeps "
                    "its own generators; the trainer seeds every step itself)", path, trainer_state["world_size"],
                    world)
    barrier()
    logger.info("loaded checkpoint %s (step %d)", path, trainer_state["step"])
    return trainer_state["step"], trainer_state["extra"]


# --------------------------------------------------------------------------- Hugging Face export


def export_hf(
    directory: str | os.PathLike,
    *,
    model: torch.nn.Module,
    model_config=None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a consolidated Hugging Face checkpoint (safetensors + config.json) of a sharded model.

    Collective: every rank gathers; rank 0 loads the full state into a fresh, unsharded
    model built on the meta device (no second copy of the weights) and calls
    ``save_pretrained``, which handles tied embeddings. ``dtype`` casts the weights.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    config = model_config if model_config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("export_hf needs model_config (the model has no .config attribute)")
    # The engine turns the KV cache off for training; a user of the export wants it on.
    config = copy.deepcopy(config)
    config.use_cache = True
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if current_rank() == 0:
        if dtype is not None:
            full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config)
        result = fresh.load_state_dict(full, strict=False, assign=True)
        fresh.tie_weights()
        still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
        if still_meta or result.unexpected_keys:
            raise ValueError(
                f"state dict does not fit {type(fresh).__name__}: missing {still_meta}, "
                f"unexpected {result.unexpected_keys}"
            )
        export_dtype = dtype or next(fresh.parameters()).dtype
        fresh.config.dtype = export_dtype
        directory.mkdir(parents=True, exist_ok=True)
        fresh.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        logger.info("exported Hugging Face checkpoint to %s", directory)
    barrier()
    return directory


class CheckpointMixin:
    """Checkpoint methods for an engine exposing ``module`` (the sharded model), ``optimizer``,
    ``lr_scheduler``, ``backend`` and ``global_step`` (FSDPEngine includes it). ``parts`` names
    other engines saved and loaded as parts of the same checkpoint (PPO's critic)."""

    def checkpoint_part(self) -> CheckpointPart:
        """This engine's model, optimizer and scheduler as a part of a checkpoint."""
        return CheckpointPart(self.module, self.optimizer, self.lr_scheduler)

    def save_checkpoint(self, directory, step: int | None = None, extra: dict | None = None,
                        keep: int | None = None, parts: dict | None = None,
                        background: bool = False) -> Path | PendingCheckpoint:
        """Save the training state as checkpoint ``step`` (default: ``global_step``) under
        ``directory``, with each engine of ``parts`` under its name (``background``: see
        :func:`save_checkpoint`)."""
        step = self.global_step if step is None else step
        return save_checkpoint(
            directory, step, model=self.module, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, backend=self.backend, extra=extra, keep=keep,
            parts={name: engine.checkpoint_part() for name, engine in (parts or {}).items()},
            background=background,
        )

    def load_checkpoint(self, directory, parts: dict | None = None) -> tuple[int, dict | None]:
        """Restore the latest checkpoint under ``directory`` (or that ``step_*`` directory), and
        each engine of ``parts`` from its part; sets ``global_step`` and returns ``(step, extra)``."""
        parts = parts or {}
        step, extra = load_checkpoint(
            directory, model=self.module, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, backend=self.backend,
            parts={name: engine.checkpoint_part() for name, engine in parts.items()},
        )
        for engine in (self, *parts.values()):
            engine.global_step = step
        return step, extra

    def export_hf(self, directory, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
        """Write a Hugging Face checkpoint (safetensors + config.json) of this engine's model."""
        return export_hf(directory, model=self.module, tokenizer=tokenizer, dtype=dtype)
