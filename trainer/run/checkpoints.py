"""When and how the job checkpoints: the save of a step (in the background with
trainer.async_checkpoint), its announcement, and the restore of a phase from a resume point.

What a checkpoint holds is ``state.py``'s (:class:`PhaseState`); this module decides when a
save is due, keeps the one background save in flight, and says on stdout which checkpoint is
complete (``checkpoint saved: PATH (phase P, step S, global step G)``: tests and users read it).
"""
from __future__ import annotations

from pathlib import Path

from polyfsdp.engines.checkpoint import PendingCheckpoint

from ..errors import ConfigError
from .resume import ResumePoint
from .state import PhaseState, TrainerPosition

CHECKPOINT_MARKER = "checkpoint saved:"


class JobCheckpoints:
    """The job's checkpoints under ``OUTPUT_DIR/checkpoints/<phase>``; ``last`` is the newest
    complete one (a Ctrl-C line names it)."""

    def __init__(self, out: Path, trainer_cfg, world: int, say) -> None:
        self.root = out / "checkpoints"
        self.cfg, self.world, self.say = trainer_cfg, world, say
        self.last: Path | None = None
        self.last_at: tuple[str, int] | None = None  # (phase, step) of ``last``
        self.pending: tuple[PendingCheckpoint, tuple[str, int], int] | None = None  # trainer.async_checkpoint's save in flight

    def due(self, step: int, total: int) -> bool:
        """Whether the phase's step ``step`` (of ``total``) ends with a checkpoint."""
        every = self.cfg.checkpoint_interval
        return every > 0 and (step % every == 0 or step == total)

    def save(self, state: PhaseState, position: TrainerPosition, wait: bool = False) -> Path:
        """Save the step's checkpoint; with trainer.async_checkpoint (and not ``wait``) its write
        finishes in the background (``last`` and the line follow when it completes)."""
        self.written()  # one save at a time: the previous background one first
        saved = state.save(self.root / position.phase, position, keep=self.cfg.keep_checkpoints,
                           background=self.cfg.async_checkpoint and not wait)
        at = (position.phase, position.phase_step)
        if isinstance(saved, PendingCheckpoint):
            self.pending = (saved, at, position.global_step)
            return saved.path
        return self._announce(Path(saved), at, position.global_step)

    def save_step(self, state: PhaseState, phase: str, step: int, global_step: int, metrics, wait: bool = False,
                  eval_due: bool = False, sampled_ahead: list | None = None,
                  max_staleness: int | None = None) -> Path:
        """:meth:`save` at ``phase``'s step ``step``, after ``metrics``' records (``eval_due``: the
        step's evaluation has not run yet; ``sampled_ahead``: each rank's queue of batches sampled
        for later steps, trainer/algos/sample_ahead.py; ``max_staleness``: the RL phase's)."""
        batch = self.cfg.sft_batch_size if phase == "sft" else self.cfg.prompts_per_step
        position = TrainerPosition(phase, step, global_step, self.world, metrics.lines, metrics.path,
                                   data_position=step * batch, eval_due=eval_due, sampled_ahead=sampled_ahead,
                                   max_staleness=max_staleness)
        return self.save(state, position, wait=wait)

    def _announce(self, path: Path, at: tuple[str, int], global_step: int) -> Path:
        self.last, self.last_at = path, at  # before the line: a Ctrl-C right after it must name this one
        self.say(f"{CHECKPOINT_MARKER} {path} (phase {at[0]}, step {at[1]}, global step {global_step})")
        return path

    def written(self, block: bool = True) -> None:
        """Finish the background save in flight: wait for it (``block``) or, between steps, only
        announce it once it has completed; a failed one raises at the next blocking call, which
        every rank reaches at the same point."""
        if self.pending is None:
            return
        pending, at, global_step = self.pending
        if block or (pending.done() and not pending.failed()):
            self.pending = None
            self._announce(pending.wait(), at, global_step)

    def restore(self, state: PhaseState, resume: ResumePoint, steps: int) -> TrainerPosition:
        """Load every part of ``state`` from ``resume``'s checkpoint; the position it continues
        from (a checkpoint past the phase's ``steps`` is refused: its "final" evaluation would
        be mislabelled)."""
        checkpoint, position = state.load(resume, say=self.say)
        self.last, self.last_at = checkpoint, (position.phase, position.phase_step)
        saved_world = position.world_size if position.world_size is not None else self.world
        if saved_world != self.world:
            self.say(f"elastic resume: {checkpoint} was saved on {saved_world} rank(s), this run has {self.world}: "
                     f"model and optimizer resharded, RNG states not restored (every step seeds its own)")
        if position.phase_step > steps:
            key = f"trainer.{resume.phase}_steps"
            raise ConfigError(f"{key}={steps}: {checkpoint} is already at {resume.phase} step {position.phase_step}; "
                              f"set {key}>={position.phase_step} to continue it, or choose another trainer.output_dir")
        return position
