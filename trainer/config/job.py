"""The job configuration: Hydra composition (trainer/config/composition.py), then strict conversion of
every group into validated dataclasses (the sections of trainer/config/sections.py and
trainer/config/algo.py, the engine's where they exist).

Any mistake a user can make on the command line (unknown key, value outside its choices,
wrong type, bad override syntax) becomes one :class:`ConfigError` with a one-line message.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import typing
from typing import Any

from polyfsdp.backends.registry import BACKEND_NAMES
from polyfsdp.engines.config import ADAPTER_EXPORTS, EngineConfig, OptimConfig
from polyfsdp.engines.model.lora import require_peft

from .algo import (RL_ALGOS, ActorSection, AlgoSection, CriticSection,
                          DistillSection, RolloutCorrectionSection, SFTSection, check_choice, check_min)
from ..algos.policy_losses import policy_loss_entry
from .composition import GROUPS, VERL_EQUIVALENTS, available_options, compose, renamed_key, to_container
from .bounds import check_bounds
from .sections import (DataSection, EvalSection, JobConfig, ModelSection,
                              RewardModelSection, RewardSection, RolloutSection, TrainerSection)
from ..errors import ConfigError
from .rollout_check import SEPARATE_SAMPLERS, check_rollout
from ..tracking import check_loggers

logger = logging.getLogger(__name__)

DATA_SOURCES = ("builtin", "jsonl", "parquet", "files", "verifiers")
TASKS = ("reverse", "arith_words", "calculator")
OVERLONG_POLICIES = ("filter", "error", "truncate")
PROGRESS_MODES = ("auto", "bar", "lines", "off")


# --------------------------------------------------------------------------- checks


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return True


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", str(hint))


def _section(cls, where: str, data: Any, nested: dict | None = None):
    """Build dataclass ``cls`` from a plain mapping: unknown keys and wrong types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            if renamed_key(f"{where}.{key}"):
                raise ConfigError(f"{where}.{key}: {renamed_key(f'{where}.{key}')}")
            if f"{where}.{key}" in VERL_EQUIVALENTS:
                raise ConfigError(f"{where}.{key}: verl's key; here it is {VERL_EQUIVALENTS[f'{where}.{key}']}")
            raise ConfigError(f"{where}.{key}: unknown key; known keys: {', '.join(known)}")
    kwargs = {}
    for key, value in data.items():
        if nested and key in nested:
            kwargs[key] = None if value is None else _section(nested[key], f"{where}.{key}", value)
            continue
        if isinstance(value, int) and not isinstance(value, bool) and _type_ok(1.0, hints[key]) \
                and not _type_ok(1, hints[key]):
            value = float(value)
        if not _type_ok(value, hints[key]):
            raise ConfigError(f"{where}.{key}: expected {_describe(hints[key])}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def _optim(where: str, data: Any, phase_steps: int, steps_key: str) -> OptimConfig:
    """A phase's OptimConfig; ``total_steps: null`` means the phase's own step count (from
    ``steps_key``)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of optimizer settings, got {data!r}")
    data = dict(data)
    derived = data.get("total_steps") is None
    if derived:
        data["total_steps"] = max(phase_steps, 1)
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


def _validate_trainer(t: TrainerSection, algo: AlgoSection) -> None:
    for key in ("sft_steps", "rl_steps", "eval_interval", "checkpoint_interval"):
        check_min(f"trainer.{key}", getattr(t, key), 0)
    for key in ("sft_batch_size", "prompts_per_step", "log_interval", "keep_checkpoints"):
        check_min(f"trainer.{key}", getattr(t, key), 1)
    check_choice("trainer.progress", t.progress, PROGRESS_MODES)
    check_choice("trainer.export_lora", t.export_lora, ADAPTER_EXPORTS)
    t.logger = check_loggers(t.logger)
    check_min("trainer.log_val_generations", t.log_val_generations, 0)
    check_min("trainer.log_rollout_samples", t.log_rollout_samples, 0)
    if not isinstance(t.tags, list) or not all(isinstance(tag, str) and tag for tag in t.tags):
        raise ConfigError(f"trainer.tags: expected a list of names, e.g. trainer.tags=[baseline,lr1e-6], "
                          f"got {t.tags!r}")
    if t.cpu_threads is not None:
        check_min("trainer.cpu_threads", t.cpu_threads, 1)
    if t.resume not in ("auto", "never") and not os.path.isdir(t.resume):
        raise ConfigError(f"trainer.resume: expected auto, never or an existing checkpoint directory, "
                          f"got {t.resume!r}")
    if algo.name == "sft" and t.sft_steps < 1:
        raise ConfigError("trainer.sft_steps: algo=sft needs at least 1 step, got 0")


def _file_list(key: str, value) -> list | None:
    if value is None:
        return None
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{key}: expected a list of file paths, e.g. {key}=[a.parquet,b.jsonl], got {value!r}")
    return files


def _validate_data(d: DataSection) -> None:
    check_choice("data.source", d.source, DATA_SOURCES)
    check_choice("data.overlong", d.overlong, OVERLONG_POLICIES)
    if d.max_prompt_length is not None:
        check_min("data.max_prompt_length", d.max_prompt_length, 1)
    if not d.prompt_key or (d.answer_key is not None and not d.answer_key):
        raise ConfigError("data.prompt_key / data.answer_key: expected a (dotted) field name, got an empty one")
    d.train_files = _file_list("data.train_files", d.train_files)
    d.val_files = _file_list("data.val_files", d.val_files)
    if d.source == "builtin" and (d.train_files or d.val_files):
        raise ConfigError("data.train_files/val_files: data=builtin does not read files; add data=files to train "
                          "on them")
    if d.source != "builtin" and d.train_files and d.path:
        raise ConfigError(f"data.path / data.train_files: give one of them, got both ({d.path!r} and "
                          f"{d.train_files})")
    if d.source == "files" and not d.train_files:
        raise ConfigError("data.train_files: data=files needs data.train_files=[FILE,...]")
    if d.source == "builtin":
        check_choice("data.task", d.task, TASKS)
        if not d.alphabet.isalpha():
            raise ConfigError(f"data.alphabet: expected letters, got {d.alphabet!r}")
        if not 1 <= d.min_len <= d.max_len:
            raise ConfigError(f"data.min_len/max_len: need 1 <= min_len <= max_len, got {d.min_len}, {d.max_len}")
        if d.path is not None:
            raise ConfigError(f"data.path: data=builtin does not read a file, got data.path={d.path!r}; "
                              f"add data=jsonl (or data=parquet) to train on it")
    elif d.source == "verifiers":
        if d.path or d.train_files or d.val_files:
            raise ConfigError("data.path/train_files/val_files: data=verifiers reads the tasks of rollout.agent's "
                              "verifiers environment, not files")
    elif not d.path and not d.train_files:
        raise ConfigError(f"data.path: data={d.source} needs data.path=FILE")
    check_min("data.eval_size", d.eval_size, 1)


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


def _validate_eval(e: EvalSection) -> None:
    check_min("eval.n_samples", e.n_samples, 1)
    if e.temperature < 0:
        raise ConfigError(f"eval.temperature: expected >= 0 (0: greedy), got {e.temperature}")
    if e.n_samples > 1 and e.temperature == 0:
        raise ConfigError(f"eval.n_samples={e.n_samples}: greedy completions (eval.temperature=0) are all the same; "
                          f"set eval.temperature>0 (e.g. 1.0) or eval.n_samples=1")
    e.validate_sampling("eval")
    if not isinstance(e.initial, bool):
        raise ConfigError(f"eval.initial: expected true or false, got {e.initial!r}")


def _check_preset_overrides(model: ModelSection) -> None:
    """Build the preset's Hugging Face config with ``model.overrides`` now: a field of the wrong
    type (``hidden_size=abc``) is one ConfigError here, not a traceback where the model is built."""
    from polyfsdp.engines.presets import preset_config

    if not isinstance(model.overrides, dict):
        raise ConfigError(f"model.overrides: expected a mapping of Hugging Face config fields, got {model.overrides!r}")
    try:
        preset_config(model.preset, **dict(model.overrides))
    except (ValueError, TypeError) as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith("model.") else f"model.overrides: {text}") from None


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
    backend = _section(dataclasses.make_dataclass("BackendSection", [("name", str)]), "backend",
                       raw.get("backend", {})).name
    check_choice("backend", backend, BACKEND_NAMES)

    model = _section(ModelSection, "model", raw["model"])
    try:
        if model.model_config(vocab_size=None).lora.enabled:
            require_peft()
    except (ValueError, TypeError, ImportError) as exc:
        raise ConfigError(str(exc)) from None
    if model.preset and not model.path:
        _check_preset_overrides(model)
    if model.dtype == "float16":
        # Every job trains; the engine refuses float16 master weights (AdamW's eps underflows).
        raise ConfigError("model.dtype=float16: training keeps master weights in float16, which AdamW turns "
                          "into NaN; use model.dtype=float32 engine.param_dtype=float16")
    model.path = _hf_directory(model)
    if model.path and not os.path.isdir(model.path):
        raise ConfigError(f"model.path: {model.path!r} is not a directory (or a .gguf file)")

    try:
        engine = EngineConfig.from_dict(raw["engine"], where="engine")
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None
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
    algo = _section(AlgoSection, "algo", raw["algo"], nested={"sft": SFTSection, "actor": ActorSection,
                                                              "critic": CriticSection,
                                                              "rollout_correction": RolloutCorrectionSection,
                                                              "distill": DistillSection})
    check_choice("algo.name", algo.name, RL_ALGOS + ("sft",))
    if algo.sft is None:
        raise ConfigError("algo.sft: expected a mapping (every algo has an SFT section), got None")
    algo.sft.optim = _optim("algo.sft.optim", algo.sft.optim, trainer.sft_steps, "trainer.sft_steps")
    algo.sft.validate("algo.sft")
    _validate_trainer(trainer, algo)
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
        algo.actor.optim = _optim("algo.actor.optim", algo.actor.optim, trainer.rl_steps * max(updates, 1),
                                  "trainer.rl_steps")
        if algo.critic is not None:
            algo.critic.optim = _optim("algo.critic.optim", algo.critic.optim, trainer.rl_steps * max(updates, 1),
                                   "trainer.rl_steps")
        algo.validate_rl(trainer.prompts_per_step, replicas)
    algo.distill = algo.distill or DistillSection()  # distill: null is no teacher
    algo.distill.validate("algo.distill", algo.rl)
    data = _section(DataSection, "data", raw["data"])
    _validate_data(data)
    if data.eval_size < world_size:
        raise ConfigError(f"data.eval_size: every rank needs an evaluation prompt; expected >= world size "
                          f"{world_size}, got {data.eval_size}")
    reward = _section(RewardSection, "reward", raw["reward"], nested={"model": RewardModelSection})
    _validate_reward(reward)
    evaluation = _section(EvalSection, "eval", raw.get("eval") or {})
    _validate_eval(evaluation)
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
