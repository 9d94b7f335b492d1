"""Sharded training checkpoints that a killed run resumes from exactly: the save and the load.

Layout of one checkpoint (``step_000120/``; the root's names and moves: ``layout.py``)::

    .metadata, *.distcp     model + optimizer shards (torch.distributed.checkpoint), and those
                            of every named part (a PPO run's critic) under ``parts.<name>.``
    trainer_state.pt        step, extra, scheduler states, the parts' names, world size  (rank 0)
    rng_rank{r}.pt          RNG states of rank r
    manifest.json           every other file's size and SHA-256 (and each DCP item's), written last (rank 0)

A checkpoint is one unit: the engine's own model and optimizer plus any named *parts*
(:class:`CheckpointPart`: other models trained in the same run, like PPO's critic), the caller's
plain ``extra`` and every rank's RNG streams share one directory, one manifest and one ``latest``,
and are kept or deleted together, so no crash can leave one part at a step the others lack.

A save writes everything into a temporary directory, waits for every rank, then rank 0
renames it into place and replaces ``latest`` atomically; older checkpoints beyond ``keep`` are
deleted only after that. So a crash at any point leaves ``latest`` naming a complete checkpoint;
so too for a save finishing in the background (``background=True``, ``background.py``),
whose commit waits for the write. Loading checks the manifest and reads every pickle with an
allow-list (``files.py``), and reads no file outside the checkpoint (``paths.py``): a damaged
or crafted checkpoint is a :class:`CheckpointError`, and nothing in it executes. Hugging Face
export: ``hf_export.py`` (re-exported here).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from polyfsdp.backends.distributed import all_gather_object, background_group, barrier, current_rank, current_world_size

from .background import PendingCheckpoint, start_background_save, wait_for_background_save
from .errors import CheckpointDamaged, CheckpointError, CheckpointSaveError
from .files import (ALL_SPANS, check_checksums, check_manifest, dcp_spans_read, load_plain, read_dcp_metadata,
                    save_plain, unread_spans, verify_checkpoint, write_manifest)
from .paths import DCP_METADATA_FILE, check_shard_files
from .layout import (TMP_PREFIX, TRAINER_STATE_FILE, complete_checkpoints, is_complete,
                                latest_checkpoint, move_into_place, prune, remove_leftovers, remove_tree,
                                step_dir_name)
from .parts import CheckpointPart, check_parts, check_plain, rng_state, set_rng_state
from .verdict import all_ranks_or_raise, safe_dcp_load
from .hf_export import export_hf

__all__ = ["CheckpointDamaged", "CheckpointError", "CheckpointPart", "PendingCheckpoint", "CheckpointSaveError",
           "checkpoint_parts", "complete_checkpoints", "export_hf", "latest_checkpoint", "load_checkpoint",
           "save_checkpoint", "step_dir_name", "verify_checkpoint", "wait_for_background_save", "TMP_PREFIX",
           "TRAINER_STATE_FILE"]

logger = logging.getLogger(__name__)

# 2: RNG and trainer state hold only tensors and plain types (weights-only loading), manifest.json.
FORMAT_VERSION = 2


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
    check_plain(extra, "extra")
    wait_for_background_save()
    main = CheckpointPart(model, optimizer, lr_scheduler)
    parts = check_parts(parts)
    directory = Path(directory)
    rank = current_rank()
    name = step_dir_name(step)
    tmp = directory / f"{TMP_PREFIX}{name}"
    final = directory / name
    def prepare() -> None:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists() or tmp.is_symlink():
                logger.warning("removing leftover %s from an interrupted save", tmp)
                remove_tree(tmp)
            tmp.mkdir()

    def sharded_states() -> tuple[dict, dict, dict]:
        state = main.saved_state()
        part_states = {part_name: part.saved_state() for part_name, part in parts.items()}
        # One DCP save for all parts: one .metadata, and a part's shards are never apart from the rest.
        return state, ({**state, "parts": part_states} if parts else state), part_states

    def write_small_files(state: dict, part_states: dict) -> None:
        save_plain(rng_state(backend), tmp / f"rng_rank{rank}.pt")
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
            move_into_place(directory, tmp, final)

    def finish(group=None) -> None:
        if rank == 0:
            remove_leftovers(directory)
            prune(directory, keep, final)
            logger.info("saved checkpoint %s", final)
        barrier(group)

    # Each stage ends with every rank learning whether any rank failed, so a full disk or an
    # unwritable directory on one rank stops all of them (nobody waits in the next collective).
    if not background:
        for stage in (prepare, write, commit):
            all_ranks_or_raise(stage, directory, tmp, final)
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
        all_ranks_or_raise(step_stage, directory, tmp, final)

    def in_background() -> None:
        for later in (lambda: upload[0].result(), commit):
            all_ranks_or_raise(later, directory, tmp, final, group)
        finish(group)

    return start_background_save(final, in_background)



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
    list and sizes, that every path the checkpoint names is a file of its own the manifest
    lists (no symbolic link, no shard file elsewhere), and hashes what it reads (``.metadata``, ``trainer_state.pt``, its RNG file,
    the items of the shard files its load plan reads); rank 0 also hashes what no rank reads. A
    problem anywhere is one :class:`CheckpointError` (:class:`CheckpointDamaged` for damage) on
    every rank. RNG states are restored only on the world size that saved them (a rank of
    another world has no stream of its own in the checkpoint: every rank keeps its generators).
    """
    wait_for_background_save()
    path = Path(directory)
    if not is_complete(path):
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint in {path} (expected step_* directories or a 'latest' file)")
        path = found
    main = CheckpointPart(model, optimizer, lr_scheduler)
    parts = check_parts(parts)
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
        metadata = read_dcp_metadata(path)  # refuses shard names that leave the checkpoint
        check_shard_files(path, metadata, expected)
        shards = dcp_spans_read(full_state, metadata, expected)
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

    safe_dcp_load(full_state, path)
    main.restore(state, trainer_state)
    for name, part in parts.items():
        part.restore(part_states[name], saved_parts[name])
    if same_world:
        set_rng_state(load_plain(path / rng_file), backend)
    elif rank == 0:
        logger.info("%s was saved on %d ranks, this run has %d: RNG states are not restored (each rank keeps "
                    "its own generators; the trainer seeds every step itself)", path, trainer_state["world_size"],
                    world)
    barrier()
    logger.info("loaded checkpoint %s (step %d)", path, trainer_state["step"])
    return trainer_state["step"], trainer_state["extra"]



class CheckpointMixin:
    """Checkpoint methods for an engine exposing ``module`` (the sharded model), ``optimizer``,
    ``lr_scheduler``, ``backend``, ``model_config`` and ``global_step`` (FSDPEngine includes it). ``parts`` names
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

    def export_hf(self, directory, tokenizer=None, dtype: torch.dtype | None = None, lora: str = "merged") -> Path:
        """Write a Hugging Face checkpoint (safetensors + config.json) of this engine's model. With
        LoRA, ``lora`` picks ``merged`` (adapters folded into the weights) or ``adapter`` (a peft
        adapter directory)."""
        adapters = self.model_config.lora if self.model_config.lora.enabled else None
        return export_hf(directory, model=self.module, tokenizer=tokenizer, dtype=dtype, lora=adapters, adapters=lora)
