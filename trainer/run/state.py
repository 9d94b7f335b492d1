"""A phase's checkpoint as named stateful parts, saved and restored by one mechanism.

The parts, in the order they are registered, saved and restored:

- ``policy``: the phase's engine (model, optimizer, scheduler): the checkpoint's main part;
- ``critic``: a critic estimator's value model (algo=ppo), a named part of the same checkpoint;
- ``trainer``: the :class:`TrainerPosition` (phase step, global step, data cursor, how many
  metrics records precede it, world size), the checkpoint's plain ``extra``;

and each rank's RNG streams, which the engine's save adds by itself. So no crash can leave one
part at a step another lacks, and pruning removes all together. The on-disk layout is that of
``engines/checkpoint/`` (the critic under ``parts.critic.``; the position's fields as
``extra``'s keys), so checkpoints written before this module existed load unchanged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from polyfsdp.engines.checkpoint import CheckpointError, PendingCheckpoint, checkpoint_parts

from ..errors import ConfigError
from .resume import ResumePoint, load_resume_point

POLICY_PART = "policy"
CRITIC_PART = "critic"  # a critic estimator's value model: its name in the RL phase's checkpoints
TRAINER_PART = "trainer"
# Where a polyfsdp before one-unit PPO checkpoints kept the critic's (checkpoints/critic/step_N).
LEGACY_CRITIC_DIR = "critic"


@dataclass
class TrainerPosition:
    """Where a run stands at a checkpoint. Every batch and sampling seed is a function of the
    step, so these numbers are all a resumed run needs to continue the same curve."""

    phase: str                # "sft" | "rl"
    phase_step: int           # the phase's optimizer steps done
    global_step: int          # steps done over all phases
    world_size: int | None    # ranks that saved it (None: a checkpoint of a polyfsdp that did not record it)
    metrics_lines: int        # metrics.jsonl records that precede it (a resume cuts the file back to them)
    metrics_path: str
    data_position: int        # examples the phase has drawn (phase_step x its batch size)
    # The held-out evaluation due at this step has not run (its record is not among metrics_lines):
    # the checkpoint is saved before it, so a resumed run evaluates first.
    eval_due: bool = False
    # rollout.max_staleness > 0: per rank, the batches sampled for the steps after this one
    # (trainer/algos/sample_ahead.py); a resumed run trains on them instead of sampling again.
    sampled_ahead: list | None = None
    # The rollout.max_staleness the RL phase ran with (None: the SFT phase, or a checkpoint saved
    # before it was recorded): a resumed run with another says so (sample_ahead.py).
    max_staleness: int | None = None

    def rank_queue(self, rank: int, world_size: int) -> list | None:
        """``rank``'s batches sampled ahead (None: none saved); a checkpoint of another world size
        cannot give each rank its own (they are per-rank shares of each step's prompts)."""
        if not self.sampled_ahead:
            return None
        if len(self.sampled_ahead) != world_size:
            raise ConfigError(f"trainer.resume: this checkpoint holds batches sampled ahead by {len(self.sampled_ahead)} "
                              f"rank(s) (rollout.max_staleness > 0), this run has {world_size}; resume on "
                              f"{len(self.sampled_ahead)} rank(s)")
        return self.sampled_ahead[rank]

    def state_dict(self) -> dict[str, Any]:
        """The position as the checkpoint's plain ``extra`` (its keys in field order; no
        ``sampled_ahead`` for a synchronous run, no ``max_staleness`` for the SFT phase)."""
        state = asdict(self)
        for optional in ("sampled_ahead", "max_staleness"):
            if state[optional] is None:
                del state[optional]
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TrainerPosition:
        """The position a checkpoint's ``extra`` holds; a missing world size is None."""
        known = {f.name for f in fields(cls)}
        # Older checkpoints lack world_size, eval_due (saved after the step's evaluation), sampled_ahead
        # and max_staleness.
        missing = sorted(known - set(state) - {"world_size", "eval_due", "sampled_ahead", "max_staleness"})
        if missing:
            raise CheckpointError(f"trainer state lacks {', '.join(missing)}")
        return cls(**{**{"world_size": None}, **{k: v for k, v in state.items() if k in known}})


class PhaseState:
    """The named parts of one phase's checkpoints (policy, critic when there is one, trainer
    position), registered in a fixed order; :meth:`save` and :meth:`load` handle all of them."""

    def __init__(self, policy, critic=None) -> None:
        # In the order they are saved and restored: the policy (the checkpoint's main part),
        # the other engines (its named parts), then the trainer position (its extra).
        self.engines: dict[str, Any] = {POLICY_PART: policy}
        if critic is not None:
            self.engines[CRITIC_PART] = critic
        self.position: TrainerPosition | None = None  # set by save() and load()

    def names(self) -> list[str]:
        """The parts' names, in order."""
        return [*self.engines, TRAINER_PART]

    @property
    def policy(self):
        return self.engines[POLICY_PART]

    def models(self) -> dict:
        """The engines saved besides the policy, by part name (the policy's checkpoint holds them)."""
        return {name: engine for name, engine in self.engines.items() if name != POLICY_PART}

    def save(self, directory: Path, position: TrainerPosition, keep: int | None,
             background: bool) -> Path | PendingCheckpoint:
        """Save every part as the checkpoint of ``position.phase_step`` under ``directory``."""
        self.position = position
        return self.policy.save_checkpoint(str(directory), step=position.phase_step, extra=position.state_dict(),
                                           keep=keep, parts=self.models(), background=background)

    def load(self, resume: ResumePoint, say) -> tuple[Path, TrainerPosition]:
        """Restore every part from ``resume``'s checkpoint (or, under resume=auto, the next older
        one when its content is damaged); returns the checkpoint loaded and the position."""
        if CRITIC_PART in self.engines:
            _refuse_legacy_critic(resume.checkpoint)
        checkpoint, extra = load_resume_point(self.policy, resume, self.models(), say=say)
        try:
            position = TrainerPosition.from_state_dict(extra or {})
        except CheckpointError as exc:
            raise ConfigError(f"trainer.resume: cannot load {checkpoint}: {exc}") from None
        self.position = position
        return checkpoint, position


def _refuse_legacy_critic(checkpoint: Path) -> None:
    """A PPO checkpoint from before the critic was a part of it: its critic is elsewhere."""
    legacy = checkpoint.parent.parent / LEGACY_CRITIC_DIR
    try:
        held = checkpoint_parts(checkpoint)
    except CheckpointError:
        return  # loading it names what is wrong
    if legacy.is_dir() and CRITIC_PART not in held:
        raise ConfigError(f"trainer.resume: {checkpoint} holds no critic: it was written by a polyfsdp that "
                          f"kept algo=ppo's critic apart (in {legacy}), which this one does not load; finish "
                          f"that run with the polyfsdp that started it, or start a new trainer.output_dir")
