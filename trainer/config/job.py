"""The job configuration: Hydra composition (trainer/config/composition.py), every group converted
into its declared section by the one converter (trainer/config/bounds.py) and checked by the
section itself (sections.py, algo.py, the engine's configs), and here the checks that span
sections (the replicas' split of the batches, a phase optimizer's step count, the reward and the
rollout together).

Any mistake a user can make on the command line (unknown key, value outside its choices,
wrong type, bad override syntax) becomes one :class:`ConfigError` with a one-line message.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from polyfsdp.backends.registry import BACKEND_NAMES
from polyfsdp.engines.config import EngineConfig, OptimConfig
from polyfsdp.engines.model.lora import require_peft

from .algo import RL_ALGOS, AlgoSection, DistillSection, check_choice
from ..algos.policy_losses import policy_loss_entry
from .composition import GROUPS, VERL_EQUIVALENTS, available_options, compose, renamed_key, to_container
from .bounds import check_bounds, convert
from .sections import (BackendSection, DataSection, EvalSection, JobConfig, ModelSection, RewardSection,
                       RolloutSection, TrainerSection)
from ..data.images import VISION_MODEL_FIX
from ..errors import ConfigError
from .rollout_check import SEPARATE_SAMPLERS, check_rollout

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- checks


def _unknown_key(key: str) -> str | None:
    """Why dotted ``key`` is not a key: it was renamed, or it is verl's name for one of ours."""
    if renamed_key(key):
        return renamed_key(key)
    if key in VERL_EQUIVALENTS:
        return f"verl's key; here it is {VERL_EQUIVALENTS[key]}"
    return None


def _section(cls, where: str, data: Any):
    """Section ``cls`` from its composed mapping (trainer/config/bounds.py: convert)."""
    return convert(cls, data, where, unknown_key=_unknown_key)


# An optimizer whose ``total_steps`` is null takes its phase's step count, which spans sections
# (trainer.sft_steps, trainer.rl_steps x the actor's updates per rollout): converted first with
# a stand-in its schedule accepts (at least its warm-up), then rebuilt by _optim.
def _with_stand_in_steps(algo_raw: Any) -> tuple[Any, set[str]]:
    """``algo_raw`` with each phase optimizer's null ``total_steps`` replaced by a stand-in, and
    the phases that had one."""
    if not isinstance(algo_raw, dict):
        return algo_raw, set()
    algo_raw, derived = dict(algo_raw), set()
    for phase in ("sft", "actor", "critic"):
        optim = algo_raw[phase].get("optim") if isinstance(algo_raw.get(phase), dict) else None
        if isinstance(optim, dict) and optim.get("total_steps") is None:
            warmup = optim.get("warmup_steps", 0)
            stand_in = max(warmup, 1) if isinstance(warmup, int) and not isinstance(warmup, bool) else 1
            algo_raw[phase] = {**algo_raw[phase], "optim": {**optim, "total_steps": stand_in}}
            derived.add(phase)
    return algo_raw, derived


def _optim(where: str, optim: OptimConfig, derived: bool, phase_steps: int, steps_key: str) -> OptimConfig:
    """A phase's OptimConfig; ``total_steps: null`` (``derived``) means the phase's own step count
    (from ``steps_key``)."""
    if not derived:
        return optim
    data = {**dataclasses.asdict(optim), "total_steps": max(phase_steps, 1)}
    try:
        return OptimConfig.from_dict(data, where=where)
    except (ValueError, TypeError) as exc:
        # The user never typed the total_steps the message compares with: say where it came from.
        origin = (f" ({where}.total_steps is null: the phase's {data['total_steps']} optimizer steps, "
                  f"from {steps_key})") if derived and "total_steps=" in str(exc) else ""
        raise ConfigError(f"{exc}{origin}") from None


def _check_replica_split(t: TrainerSection, algo: AlgoSection, world_size: int, sp_size: int) -> None:
    """Each step's examples are split over the data-parallel replicas (world size / sp), not
    over ranks (docs/architecture.md, "Ranks, replicas and SP groups"): the counts must divide."""
    replicas = world_size // sp_size
    words = f"the world size {world_size}" if sp_size == 1 else \
        f"the data-parallel replicas {replicas} (world size {world_size} / engine.ulysses_sp_size {sp_size})"
    counts = {"trainer.sft_batch_size": t.sft_batch_size, "trainer.prompts_per_step": t.prompts_per_step}
    if algo.actor is not None and algo.rl and isinstance(algo.actor.mini_batch_size, int):
        # Every replica takes the same optimizer steps.
        counts["algo.actor.mini_batch_size"] = algo.actor.mini_batch_size
    for key, value in counts.items():
        if isinstance(value, int) and value >= 1 and value % replicas:
            raise ConfigError(f"{key}: must be a multiple of {words}, got {value}")


def _validate_reward(r: RewardSection) -> None:
    from ..rewards.rules import BUILTIN_REWARDS

    # Files and modules are imported when the job starts (before any model is built).
    if ":" not in r.fn and r.fn not in ("auto", "none", *BUILTIN_REWARDS):
        raise ConfigError(f"reward.fn: got {r.fn!r}; expected auto, none (a reward model alone), a built-in ({', '.join(BUILTIN_REWARDS)}), "
                          f"path/to/file.py:function or package.module:function")
    if any(not isinstance(k, str) or not k.isidentifier() for k in r.kwargs or {}):
        raise ConfigError(f"reward.kwargs: keys must be Python identifiers, got {sorted(map(str, r.kwargs or {}))}")
    from ..rewards.sources import validate_sources

    validate_sources(r)  # reward.model and the weights, routing and names of the sources


def _check_preset_overrides(model: ModelSection):
    """Build the preset's Hugging Face config with ``model.overrides`` now: a field of the wrong
    type (``hidden_size=abc``) is one ConfigError here, not a traceback where the model is built.
    Returns the config."""
    from polyfsdp.engines.presets import preset_config

    if not isinstance(model.overrides, dict):
        raise ConfigError(f"model.overrides: expected a mapping of Hugging Face config fields, got {model.overrides!r}")
    try:
        config = preset_config(model.preset, **dict(model.overrides))
    except (ValueError, TypeError) as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith("model.") else f"model.overrides: {text}") from None
    _check_mrope_fits(model, config)
    return config


def _check_task_fits_model(data: DataSection, model: ModelSection, preset_config) -> None:
    """The built-in visual task's prompts are images: a text preset is refused before any data is
    drawn (``preset_config``: the preset's built config; None for model.path, whose processor
    is checked when the prompts are encoded, trainer/data/chat.py)."""
    if data.source != "builtin" or data.task != "count_squares" or preset_config is None:
        return
    if getattr(preset_config, "vision_config", None) is None:
        raise ConfigError(f"data.task=count_squares: its prompts are images, but model.preset={model.preset} is a "
                          f"text model (no image processor); use task=count_squares (the preset that also sets "
                          f"model=qwen2_vl), or {VISION_MODEL_FIX}")


def _check_mrope_fits(model: ModelSection, config) -> None:
    """A vision-language preset rotates by mrope sections that must fill half a head: the text
    presets' overrides (the default model group's) change the head and break it in the forward."""
    text = config.get_text_config()
    sections = (getattr(text, "rope_parameters", None) or {}).get("mrope_section")
    if not sections or not getattr(text, "num_attention_heads", None):
        return
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if 2 * sum(sections) != head_dim:
        raise ConfigError(f"model.overrides: give {model.preset} a head of {head_dim} (hidden_size "
                          f"{text.hidden_size} / {text.num_attention_heads} heads) and its mrope sections "
                          f"{list(sections)} need {2 * sum(sections)}; the default model group's overrides are a "
                          f"text preset's: use model=qwen2_vl (model.preset=... for the other families)")


def _hf_directory(model: ModelSection) -> str | None:
    """``model.path``, or the cached Hugging Face directory its GGUF file converts to (the one
    place a GGUF path is resolved; ``raw`` keeps the path as given, so config.yaml and a resumed
    run name the GGUF file)."""
    if not model.path:
        return model.path
    from polyfsdp.backends.topology import launch_env
    from polyfsdp.engines.model.gguf import GGUFError, resolve_model_path

    try:
        return resolve_model_path(model.path, model.dtype, local_rank=launch_env().local_rank)
    except GGUFError as exc:
        raise ConfigError(str(exc)) from None


def without_unused_preset(raw: dict) -> dict:
    """``raw`` with ``model.preset`` and ``model.overrides`` emptied when ``model.path`` is set: the
    directory's own config is the model, so config.yaml (and --cfg) must not claim a preset's."""
    model = raw.get("model")
    if not isinstance(model, dict) or not model.get("path"):
        return raw
    return {**raw, "model": {**model, "preset": None, "overrides": {}}}


def build_job_config(raw: dict, world_size: int = 1) -> JobConfig:
    """Convert a composed, resolved config dict into a validated :class:`JobConfig`."""
    unknown = [k for k in raw if k not in GROUPS]
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key; known: {', '.join(GROUPS)}")
    # rollout came later: configs saved before it (resumed runs) default it.
    missing = [g for g in GROUPS if raw.get(g) is None and g not in ("rollout", "eval")]
    if missing:
        raise ConfigError(f"{missing[0]}: missing; choose an option with {missing[0]}=OPTION "
                          f"({', '.join(available_options(missing[0]))})")
    check_bounds(raw)  # first: NaN or a huge size would otherwise reach checks that assume a sane number
    raw = without_unused_preset(raw)
    backend = _section(BackendSection, "backend", raw.get("backend", {})).name
    check_choice("backend", backend, BACKEND_NAMES)

    model = _section(ModelSection, "model", raw["model"])
    try:
        if model.model_config(vocab_size=None).lora.enabled:
            require_peft()
    except (ValueError, TypeError, ImportError) as exc:
        raise ConfigError(str(exc)) from None
    preset = _check_preset_overrides(model) if model.preset and not model.path else None
    if model.dtype == "float16":
        # Every job trains; the engine refuses float16 master weights (AdamW's eps underflows).
        raise ConfigError("model.dtype=float16: training keeps master weights in float16, which AdamW turns "
                          "into NaN; use model.dtype=float32 engine.param_dtype=float16")
    model.path = _hf_directory(model)
    if model.path and not os.path.isdir(model.path):
        raise ConfigError(f"model.path: {model.path!r} is not a directory (or a .gguf file)")

    engine = _section(EngineConfig, "engine", raw["engine"])
    sp_size = engine.ulysses_sp_size
    if world_size % sp_size:
        raise ConfigError(f"engine.ulysses_sp_size={sp_size}: must divide the world size {world_size} (each "
                          f"data-parallel replica is one sequence-parallel group of that many ranks)")

    from polyfsdp.patches.registry import validate_toggles
    from polyfsdp.patches.toggles import PatchToggles

    try:
        patches = validate_toggles(PatchToggles.from_config(raw["patches"]))
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc) if str(exc).startswith("patches") else f"patches: {exc}") from None

    trainer = _section(TrainerSection, "trainer", raw["trainer"])
    algo_raw, derived = _with_stand_in_steps(raw["algo"])
    algo = _section(AlgoSection, "algo", algo_raw)
    check_choice("algo.name", algo.name, RL_ALGOS + ("sft",))
    if algo.sft is None:
        raise ConfigError("algo.sft: expected a mapping (every algo has an SFT section), got None")
    algo.sft.optim = _optim("algo.sft.optim", algo.sft.optim, "sft" in derived, trainer.sft_steps, "trainer.sft_steps")
    algo.sft.validate("algo.sft")
    trainer.check()
    if algo.name == "sft" and trainer.sft_steps < 1:
        raise ConfigError("trainer.sft_steps: algo=sft needs at least 1 step, got 0")
    _check_replica_split(trainer, algo, world_size, sp_size)
    replicas = world_size // sp_size
    rollout = _section(RolloutSection, "rollout", raw.get("rollout") or {})
    check_rollout(rollout, world_size)
    if algo.rollout_correction is not None:
        # tis_cap: auto corrects stale samples only where the actor's loss takes per-token corrections.
        per_token = algo.rl and algo.actor is not None and \
            policy_loss_entry(algo.actor.policy_loss).per_token_corrections
        algo.rollout_correction.resolve("algo.rollout_correction", separate_sampler=rollout.engine in SEPARATE_SAMPLERS,
                                        max_staleness=rollout.max_staleness, per_token_corrections=per_token)
    if algo.rl:
        if algo.actor is None:
            raise ConfigError(f"algo.actor: algo={algo.name} needs its actor section")
        # The schedule counts optimizer steps: several per rollout with mini-batches or epochs.
        updates = algo.actor.updates_per_rollout(trainer.prompts_per_step)
        steps = trainer.rl_steps * max(updates, 1)
        algo.actor.optim = _optim("algo.actor.optim", algo.actor.optim, "actor" in derived, steps, "trainer.rl_steps")
        if algo.critic is not None:
            algo.critic.optim = _optim("algo.critic.optim", algo.critic.optim, "critic" in derived, steps,
                                       "trainer.rl_steps")
        algo.validate_rl(trainer.prompts_per_step, replicas)
    algo.distill = algo.distill or DistillSection()  # distill: null is no teacher
    algo.distill.validate("algo.distill", algo.rl)
    data = _section(DataSection, "data", raw["data"])
    data.check()
    _check_task_fits_model(data, model, preset)
    if data.eval_size < world_size:
        raise ConfigError(f"data.eval_size: every rank needs an evaluation prompt; expected >= world size "
                          f"{world_size}, got {data.eval_size}")
    reward = _section(RewardSection, "reward", raw["reward"])
    _validate_reward(reward)
    evaluation = _section(EvalSection, "eval", raw.get("eval") or {})
    evaluation.check()
    lora_enabled = model.model_config().lora.enabled
    if trainer.export_lora != "merged" and not lora_enabled:
        raise ConfigError(f"trainer.export_lora={trainer.export_lora!r} exports LoRA adapters; set model.lora.rank > 0")
    if (data.source == "verifiers") != str(rollout.agent).startswith("verifiers:"):
        raise ConfigError(f"data.source={data.source} with rollout.agent={rollout.agent}: a verifiers environment "
                          f"trains on its own tasks; set both rollout.agent=verifiers:ENV_ID and data=verifiers")
    if (rollout.env is not None or rollout.agent is not None) and algo.rl and not algo.estimator.multi_turn:
        key = "env" if rollout.env is not None else "agent"
        raise ConfigError(f"rollout.{key}: algo.adv_estimator={algo.adv_estimator} declares multi_turn=False (it "
                          f"cannot skip environment turns); choose one that handles them, e.g. grpo or gae")
    return JobConfig(backend=backend, model=model, engine=engine, patches=patches, algo=algo, data=data,
                     trainer=trainer, raw=raw, reward=reward, rollout=rollout, eval=evaluation)


def load_config(overrides: list[str], world_size: int = 1) -> JobConfig:
    """Compose, resolve and validate: the one call the entry point makes."""
    return build_job_config(to_container(compose(overrides)), world_size=world_size)
