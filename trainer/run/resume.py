"""Where a run continues (``trainer.resume``) and whether it may: the rules in one place.

``find_resume`` turns ``auto`` / ``never`` / a checkpoint path into a :class:`ResumePoint`;
``check_same_run`` refuses to continue a run with settings that decide the model, the data
stream or the updates (its checkpoints would be loaded while config.yaml claimed others).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


from polyfsdp.engines.checkpoint import CheckpointDamaged, CheckpointError, complete_checkpoints, latest_checkpoint
from polyfsdp.engines.checkpoint.files import check_manifest

from ..algos.policy_losses import policy_loss_entry
from ..config.algo import auto_tis_cap
from ..config.composition import renamed_key
from ..config.sections import JobConfig, RolloutSection
from ..config.job import without_unused_preset
from ..config.bounds import defaults_of
from ..config.reference import group_sections, optional_sections
from ..config.saved_run import read_saved_yaml
from ..errors import ConfigError
from ..evaluation.generations_log import GENERATIONS_FILE
from ..tracking import IDS_FILE
from ..tracking.metrics import METRICS_FILE
from ..tracking.mlflow_tracker import ARTIFACTS_SUBDIR as MLFLOW_ARTIFACTS_SUBDIR, STORE_FILE as MLFLOW_STORE_FILE
from ..tracking.plot import CURVES_FILE
from ..tracking.tensorboard_tracker import LOG_SUBDIR as TENSORBOARD_SUBDIR
from ..tracking.wandb_tracker import FILES_SUBDIR as WANDB_SUBDIR

# Written next to the SFT-end export: how many metrics records precede the RL phase's start.
STATE_FILE = "polyfsdp_state.json"
# The RL phase: checkpoints/rl/, metrics records of phase "rl". Before it was named after one
# algorithm it was "grpo": such a run (its checkpoints, its config.yaml's algo.grpo) is refused
# with one line, since its records and settings carry the old names.
RL_PHASE = "rl"
LEGACY_RL_PHASE = "grpo"
PHASES = ("sft", RL_PHASE)
# Settings a continued run must share with the run it continues: they decide the model, the
# data each step draws (a function of seed, phase, step and batch size) and the updates (the
# whole algo group: algorithm, advantage estimator, rollout correction, losses, KL, group size,
# optimizers). The rest (step counts, intervals, logging, engine modes, patches, backend) may
# change on resume.
SAME_RUN_SECTIONS = ("model", "data", "reward", "algo")
SAME_RUN_TRAINER_KEYS = ("seed", "sft_batch_size", "prompts_per_step")
# Once the RL phase has its starting model (the SFT export, or none with sft_steps=0), the SFT
# step count decides that model (the RL reference, LoRA's frozen base): it must stay too.
RL_STARTED_TRAINER_KEYS = ("sft_steps",)
# Keys of those sections that change how a run is guarded, not what it computes.
SAME_RUN_IGNORED = ("reward.timeout_s",)
# The rollout keys that define the task a multi-turn run trains on (its engine may change).
SAME_RUN_ROLLOUT_KEYS = ("env", "agent", "env_kwargs", "max_turns", "max_total_tokens", "env_add_reward_fn")
# A key whose value may be ``auto``: spelled differently in the two runs (auto in one, the value it
# means in the other, e.g. a config.yaml saved when null was the default), it compares by the value
# each run uses.
TIS_CAP = "algo.rollout_correction.tis_cap"


# The files polyfsdp-train writes in place in its output directory (config.yaml; the trackers'
# ids; appended validation completions; the curves; MLflow's SQLite store): the others are
# written to a temporary file renamed over them, or live in directories of their own.
WRITTEN_IN_PLACE = ("config.yaml", IDS_FILE, GENERATIONS_FILE, CURVES_FILE, MLFLOW_STORE_FILE)
# The folders whose files others write for the run: the trackers (TensorBoard's event files, W&B's
# run, MLflow's artifacts) and the rollout servers' logs (job.py's log_dir), all appended to.
WRITTEN_INTO = (TENSORBOARD_SUBDIR, WANDB_SUBDIR, MLFLOW_ARTIFACTS_SUBDIR, "rollout_servers")


@dataclass
class ResumePoint:
    """Where a run continues: ``phase`` from ``checkpoint`` (None: the phase's start) of ``run_dir``;
    ``older``: under ``resume=auto``, the phase's older checkpoints to fall back to, newest first,
    when loading finds ``checkpoint``'s content damaged (:func:`load_resume_point`)."""

    phase: str
    checkpoint: Path | None
    run_dir: Path
    older: list[Path] = field(default_factory=list)


def legacy_run_line(run_dir: Path) -> str:
    """The one line refusing to continue a run started before the RL phase got neutral names."""
    return (f"trainer.resume: {run_dir} was started by a polyfsdp that named the RL phase grpo (checkpoints/grpo/, "
            f"algo.grpo, trainer.grpo_steps; now checkpoints/rl/, algo.actor, algo.critic, trainer.rl_steps); "
            f"finish it with the polyfsdp that started it, or choose another trainer.output_dir")


def sft_complete(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds the SFT phase's finished export."""
    return (run_dir / "sft_model" / STATE_FILE).is_file()


def _explicit_point(cfg: JobConfig, mode: str) -> ResumePoint:
    path = Path(mode).resolve()
    # PATH is .../checkpoints/<phase>[/step_N] of a polyfsdp-train run.
    phase_dir = path if path.name in (*PHASES, LEGACY_RL_PHASE) else path.parent
    if phase_dir.name == LEGACY_RL_PHASE and phase_dir.parent.name == "checkpoints":
        raise ConfigError(legacy_run_line(phase_dir.parent.parent))
    if phase_dir.name not in PHASES or phase_dir.parent.name != "checkpoints":
        raise ConfigError(f"trainer.resume: {mode!r} is not a polyfsdp-train checkpoint "
                          f"(expected OUTPUT_DIR/checkpoints/sft|rl[/step_N])")
    if phase_dir.name == RL_PHASE and cfg.algo.name == "sft":
        raise ConfigError(f"trainer.resume: {mode!r} is an RL checkpoint, but algo=sft runs no RL phase; "
                          f"resume with algo=grpo or from OUTPUT_DIR/checkpoints/sft")
    found = path if path.name.startswith("step_") else latest_checkpoint(path)
    if found is None:
        raise ConfigError(f"trainer.resume: no complete checkpoint in {mode!r}")
    # An explicit choice that is damaged is not substituted: loading it verifies it (one line).
    return ResumePoint(phase_dir.name, found, phase_dir.parent.parent)


def intact_checkpoints(phase_dir: Path, say=print) -> list[Path]:
    """The checkpoints of ``phase_dir`` whose manifest's file list and sizes check out, the one
    ``latest`` names first, then newest first; each that does not is skipped with a line saying
    why (a save cut short by a full disk, a truncated copy). Reads no file's content: the load
    hashes what each rank reads, and :func:`load_resume_point` falls back past a damaged one.
    A run directory may be crafted: a ``latest`` naming anything but a ``step_*`` directory of
    ``phase_dir``, or a checkpoint whose paths leave it (a file that is a symbolic link, a
    manifest naming a path), is refused in one line; a ``step_*`` that is a symbolic link is
    skipped (its files would come from outside the run). So is, when it holds checkpoints, a
    ``phase_dir`` reached through a symbolic link (``checkpoints`` or the phase itself): a crafted
    run's link would have this run resume from another run's checkpoints, then save and prune there."""
    linked = next((d for d in (phase_dir.parent, phase_dir) if d.is_symlink()), None)
    if linked is not None and complete_checkpoints(phase_dir):
        raise ConfigError(f"trainer.resume=auto: {linked} is a symbolic link (to {os.readlink(linked)}); refused: a "
                          f"run's checkpoints are read only from its own directory; move them back into it")
    try:
        # ``latest`` first: a run restarted from an earlier step re-points it.
        pointed = latest_checkpoint(phase_dir)
    except CheckpointError as exc:
        raise ConfigError(f"trainer.resume=auto: {exc}") from None
    newest_first = [p for p in reversed(complete_checkpoints(phase_dir)) if p != pointed]
    found = []
    for candidate in ([pointed] if pointed is not None else []) + newest_first:
        if candidate.is_symlink():
            say(f"trainer.resume=auto: skipping {candidate}: a symbolic link (to {os.readlink(candidate)}); a run's "
                f"checkpoints are read only from its own directory")
            continue
        try:
            check_manifest(candidate)
        except CheckpointDamaged as exc:
            say(f"trainer.resume=auto: skipping {candidate}: {exc}")
            continue
        except CheckpointError as exc:
            raise ConfigError(f"trainer.resume=auto: {exc}") from None
        found.append(candidate)
    return found


def find_resume(cfg: JobConfig, out: Path, say=print) -> ResumePoint | None:
    """The point ``trainer.resume`` asks to continue from, or None for a fresh run; ``say``
    reports the checkpoints ``auto`` skipped."""
    mode = cfg.trainer.resume
    if mode == "never":
        for name in ("checkpoints", "sft_model", METRICS_FILE):
            if (out / name).exists():
                raise ConfigError(f"trainer.resume=never but {out} already holds a run ({name}); "
                                  f"choose another trainer.output_dir or use trainer.resume=auto")
        return None
    if mode != "auto":
        return _explicit_point(cfg, mode)
    ckpt_root = out / "checkpoints"
    if (ckpt_root / LEGACY_RL_PHASE).is_dir():
        raise ConfigError(legacy_run_line(out))
    rl_ckpts = intact_checkpoints(ckpt_root / RL_PHASE, say)
    rl_ckpt = rl_ckpts[0] if rl_ckpts else None
    if cfg.algo.name == "sft" and (sft_complete(out) or rl_ckpt is not None):
        # Resuming its SFT checkpoints would cut the RL records and overwrite final/.
        raise ConfigError(f"trainer.resume=auto: {out} holds an RL run, but algo=sft was asked for; "
                          f"choose another trainer.output_dir or resume with its RL algo (grpo, ppo)")
    if cfg.algo.rl and rl_ckpt is not None:
        return ResumePoint(RL_PHASE, rl_ckpt, out, rl_ckpts[1:])
    if cfg.algo.rl and cfg.trainer.sft_steps > 0 and sft_complete(out):
        return ResumePoint(RL_PHASE, None, out)
    sft_ckpts = intact_checkpoints(ckpt_root / "sft", say)
    return ResumePoint("sft", sft_ckpts[0], out, sft_ckpts[1:]) if sft_ckpts else None


def _section(raw: dict, dotted: str) -> dict | None:
    for part in dotted.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def _leaves(tree, prefix: str) -> dict:
    """``{"a.b.c": value}`` for every leaf of a nested mapping (a non-mapping is one leaf)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}"))
    return out


def _merged(defaults, saved):
    if not (isinstance(defaults, dict) and isinstance(saved, dict)):
        return saved
    return {**defaults, **{key: _merged(defaults.get(key), value) for key, value in saved.items()}}


def _with_declared_defaults(saved_raw: dict) -> dict:
    """A saved config with each key it was saved without at its declared default: a key added
    since (the sampling controls, distillation, a data source's unused keys) had that value."""
    out = {**saved_raw, **{group: _merged(defaults_of(cls), saved_raw[group])
                           for group, cls in group_sections().items() if isinstance(saved_raw.get(group), dict)}}
    for path, cls in optional_sections().items():
        group, leaf = path.split(".")
        section = out.get(group)
        if isinstance(section, dict) and isinstance(section.get(leaf), dict):
            out[group] = {**section, leaf: _merged(defaults_of(cls), section[leaf])}
    return out


def _algo_leaves(before_raw: dict, now_raw: dict) -> tuple[dict, dict]:
    """The algo settings to compare: all of them, except that an algo=sft run may continue into
    an RL algorithm (it has no RL settings to keep yet; only its SFT settings must stay)."""
    old, new = _section(before_raw, "algo") or {}, _section(now_raw, "algo") or {}
    if old.get("name") == "sft" and new.get("name") != "sft":
        old, new = {"sft": old.get("sft")}, {"sft": new.get("sft")}
    return _leaves(old, "algo"), _leaves(new, "algo")


def check_no_linked_run_files(out: Path) -> None:
    """A ConfigError naming the first path of ``out`` that the run would write through to a file
    outside it (a run directory may be crafted, or copied with its files shared):

    - a file of :data:`WRITTEN_IN_PLACE` that is a symbolic link: writing it would overwrite (a
      dangling link: create) whatever the link points at;
    - one that is a hard link (more than one name): written in place, the file changes under its
      other names too, e.g. in the run a ``cp -al`` or ``rsync --link-dest`` copy shares it with;
    - a folder of :data:`WRITTEN_INTO` that is a symbolic link: the trackers and the servers'
      logs would write their files wherever it points.

    Files the run only reads back, or replaces by renaming a new file over them (checkpoints,
    trainer state, metrics.jsonl), may be hard links: reading one reads what its creator could
    read anyway (a hard link, unlike a symbolic one, names no path resolved as the reader), its
    content is checked as any file's, and a rename or a prune changes only the run's name."""
    for name in WRITTEN_IN_PLACE:
        path = out / name
        if path.is_symlink():
            raise ConfigError(f"trainer.output_dir {out}: {path} is a symbolic link (to {os.readlink(path)});"
                              f" refused: polyfsdp-train writes its files only inside its output directory; remove "
                              f"the link or choose another trainer.output_dir")
        names = path.stat().st_nlink if path.is_file() else 1
        if names > 1:
            raise ConfigError(f"trainer.output_dir {out}: {path} is a hard link ({names} names for one file); refused: "
                              f"polyfsdp-train writes it in place, which would change the file under its other names "
                              f"too (a copy made with cp -al or rsync --link-dest shares it with the original); give "
                              f"the run its own copy (cp {path} {path}.copy && mv {path}.copy {path}) or choose "
                              f"another trainer.output_dir")
    for name in WRITTEN_INTO:
        folder = out / name
        if folder.is_symlink():
            raise ConfigError(f"trainer.output_dir {out}: {folder} is a symbolic link (to {os.readlink(folder)}); "
                              f"refused: what is written into it (trainer.logger's files, the rollout servers' logs) "
                              f"would land outside the output directory; remove the link or choose another "
                              f"trainer.output_dir")


def _tis_cap_as_used(before: dict, now: dict, before_raw: dict, cfg: JobConfig) -> None:
    """Replace :data:`TIS_CAP` in ``before`` and ``now`` by the value each run uses when they
    are spelled differently: ``auto`` resolves with the run's own rollout.max_staleness (its
    policy loss is this run's: a different one is refused by its own key)."""
    if TIS_CAP not in now or before.get(TIS_CAP) == now[TIS_CAP] or cfg.algo.rollout_correction is None:
        return
    now[TIS_CAP] = cfg.algo.rollout_correction.tis_cap
    staleness = _section(before_raw, "rollout.max_staleness")
    staleness = RolloutSection().max_staleness if staleness is None else staleness  # saved before the key
    if before.get(TIS_CAP) == "auto" and type(staleness) is int and cfg.algo.actor is not None and \
            before.get("algo.actor.policy_loss") == now.get("algo.actor.policy_loss"):
        per_token = policy_loss_entry(cfg.algo.actor.policy_loss).per_token_corrections
        before[TIS_CAP] = auto_tis_cap(staleness, per_token)


def check_same_run(cfg: JobConfig, run_dir: Path) -> None:
    """A run continued in (or from) ``run_dir`` must ask for the model, data and algorithm
    it was started with: its init_model and checkpoints would be loaded and the data stream
    continued, while config.yaml claimed the new settings. A run directory without its
    config.yaml cannot be checked, so it is refused (its init_model would be reused whatever
    ``model.overrides`` now say)."""
    saved = run_dir / "config.yaml"
    held = [name for name in ("checkpoints", "sft_model", "init_model") if (run_dir / name).exists()]
    if not held:
        return
    if not saved.is_file():
        raise ConfigError(f"trainer.resume={cfg.trainer.resume}: {run_dir} holds a run ({', '.join(held)}) but no "
                          f"config.yaml, so this run's settings (model.overrides, data, algo) cannot be checked "
                          f"against it; put its config.yaml back or choose another trainer.output_dir")
    trained = "checkpoints" in held or "sft_model" in held
    # A run that stopped before its first checkpoint (a reward that raised at the first
    # evaluation, say) left only init_model, which the next run reuses: only the model must
    # match, so the user can fix the reward or the data and run again in the same directory.
    # A config.yaml written before model.path dropped the unused preset still names one.
    before_raw = read_saved_yaml(saved)
    if not isinstance(before_raw, dict):
        raise ConfigError(f"{saved}: expected a mapping of config groups, got {type(before_raw).__name__}")
    before_raw = without_unused_preset(before_raw)
    if trained and ((run_dir / "checkpoints" / LEGACY_RL_PHASE).is_dir()
                    or any(renamed_key(f"algo.{key}") for key in (_section(before_raw, "algo") or {}))):
        raise ConfigError(legacy_run_line(run_dir))
    before_raw = _with_declared_defaults(before_raw)
    before, now = {}, {}
    for dotted in SAME_RUN_SECTIONS if trained else ("model",):
        if dotted == "algo":
            old, new = _algo_leaves(before_raw, cfg.raw)
        else:
            old = _leaves(_section(before_raw, dotted) or {}, dotted)
            new = _leaves(_section(cfg.raw, dotted) or {}, dotted)
        before.update(old)
        now.update(new)
    _tis_cap_as_used(before, now, before_raw, cfg)
    trainer_keys = SAME_RUN_TRAINER_KEYS if trained else ()
    if sft_complete(run_dir) or (run_dir / "checkpoints" / RL_PHASE).is_dir():
        trainer_keys += RL_STARTED_TRAINER_KEYS
    for section, keys in (("trainer", trainer_keys), ("rollout", SAME_RUN_ROLLOUT_KEYS if trained else ())):
        section_before, section_now = before_raw.get(section) or {}, cfg.raw.get(section) or {}
        for key in keys:
            # A key a run saved before it existed had its default, which is what None stands for here.
            default = getattr(RolloutSection(), key) if section == "rollout" else None
            old, new = section_before.get(key, default), section_now.get(key, default)
            before[f"{section}.{key}"], now[f"{section}.{key}"] = old, new
    for name in list(now) + [k for k in before if k not in now]:
        if before.get(name) != now.get(name) and name not in SAME_RUN_IGNORED:
            raise ConfigError(f"trainer.resume={cfg.trainer.resume}: {run_dir} holds a run of {name}="
                              f"{before.get(name)!r}, but this run asks for {name}={now.get(name)!r}; keep "
                              f"the model, data and algo settings (and trainer.seed, sft_batch_size, "
                              f"prompts_per_step, and sft_steps once the RL phase began, and the rollout's "
                              f"environment) or choose another trainer.output_dir")


def load_resume_checkpoint(engine, checkpoint: Path, parts: dict | None = None,
                           damaged_ok: bool = False) -> tuple[int, dict]:
    """Load a resume checkpoint (with the engines of ``parts``, e.g. PPO's critic); one that is
    incomplete or unreadable is a ConfigError (``damaged_ok``: damage stays CheckpointDamaged)."""
    try:
        return engine.load_checkpoint(str(checkpoint), parts=parts)
    except CheckpointError as exc:
        if damaged_ok and isinstance(exc, CheckpointDamaged):
            raise
        raise ConfigError(f"trainer.resume: cannot load {checkpoint}: {exc}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        # A model that does not fit the checkpoint's shards (dcp raises RuntimeError/ValueError).
        raise ConfigError(f"trainer.resume: cannot load {checkpoint}: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}") from None


def load_resume_point(engine, resume: ResumePoint, parts: dict | None = None, say=print) -> tuple[Path, dict]:
    """Load ``resume.checkpoint`` (see :func:`load_resume_checkpoint`); under ``resume=auto`` one
    whose content turns out damaged is skipped with a line for the next of ``resume.older`` (the
    same on every rank: the load's verdict is). Returns the checkpoint loaded and its ``extra``."""
    checkpoint, older = resume.checkpoint, list(resume.older)
    while True:
        try:
            return checkpoint, load_resume_checkpoint(engine, checkpoint, parts, damaged_ok=bool(older))[1]
        except CheckpointDamaged as exc:
            skipped, checkpoint = checkpoint, older.pop(0)
            say(f"trainer.resume=auto: skipping {skipped}: {exc}; resuming {resume.phase} from {checkpoint}")
