"""The phases of a job (SFT warm-up, then RL) and what differs between them.

:func:`plan_phases` lists the phases a run still has to go through, each a :class:`Phase`
naming its data stream, step counts, starting model, closing evaluation and export; the job
runs every phase with the same loop (``job.py``). :func:`engine_settings` says what each engine
of a phase is built with.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..algos.distill.teacher import teacher_model_config
from ..config.sections import JobConfig
from ..data.sources import RL_DATA_STREAM
from .resume import RL_PHASE, ResumePoint


@dataclass
class Phase:
    """What differs between the SFT and RL phases; :meth:`Job._run_phase` runs either."""

    name: str                 # "sft" | "rl": checkpoints/<name>/, metrics records
    stream: str               # the data stream its examples are drawn from (source.batch)
    steps: int                # the phase's optimizer steps
    batch_size: int           # examples drawn per step, over all ranks
    step_offset: int          # global step of the phase's start
    start_dir: str            # the model the phase starts from
    end_tag: str              # the evaluation at its end ("after_sft" or "final")
    export_dir: Path | None   # where its end model is exported (None: not exported)
    export_state: bool        # write the metrics position with the export (the RL phase's starting point)
    mid_evaluations: bool     # evaluate every trainer.eval_interval steps


def plan_phases(cfg: JobConfig, out: Path, start_dir: str, resume: ResumePoint | None) -> list[Phase]:
    """The phases still to run in ``out``: SFT (unless skipped, or already done when resuming
    RL), then RL; the first starts from ``start_dir``."""
    t = cfg.trainer
    rl = cfg.algo.rl
    sft_dir = out / "sft_model" if t.sft_steps > 0 else Path(start_dir)
    if resume is not None and resume.run_dir != out and resume.phase == RL_PHASE and t.sft_steps > 0:
        sft_dir = resume.run_dir / "sft_model"
    phases = []
    if (resume is None or resume.phase == "sft") and (t.sft_steps > 0 or not rl):
        end_dir = sft_dir if rl else (out / "final" if t.export else None)
        phases.append(Phase("sft", "sft", t.sft_steps, t.sft_batch_size, 0, start_dir,
                            end_tag="after_sft" if rl else "final", export_dir=end_dir, export_state=rl,
                            mid_evaluations=False))
    if rl:
        phases.append(Phase(RL_PHASE, RL_DATA_STREAM, t.rl_steps, t.prompts_per_step, t.sft_steps, str(sft_dir),
                            end_tag="final", export_dir=out / "final" if t.export else None,
                            export_state=False, mid_evaluations=True))
    return phases


def engine_settings(cfg: JobConfig, phase: str, model_dir: str, role: str) -> tuple:
    """``(OptimConfig, ModelConfig)`` of the engine playing ``role`` in ``phase`` on ``model_dir``:
    the policy (and the frozen reference) with the phase's optimizer; a critic with a value head
    and its own; algo.distill's teacher without adapters (it never trains)."""
    section = cfg.algo.sft if phase == "sft" else cfg.algo.actor
    model_config = cfg.model.model_config(path=model_dir)
    if role == "critic":
        section = cfg.algo.critic
        model_config = replace(model_config, value_head=True, value_head_init_std=section.value_head_init_std,
                               value_head_path=section.value_head_path)
    elif role == "teacher":
        model_config = teacher_model_config(cfg.model, model_dir)
    return section.optim, model_config
