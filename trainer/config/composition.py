"""Hydra composition of ``pkg://polyfsdp.configs`` with every Hydra/OmegaConf error turned
into one :class:`ConfigError` line naming the key (trainer/config/job.py validates the result)."""
from __future__ import annotations

import re

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError

CONFIG_MODULE = "polyfsdp.configs"
CONFIG_NAME = "train"
GROUPS = ("backend", "model", "engine", "patches", "algo", "data", "reward", "rollout", "eval", "trainer")
# Groups of presets that set keys of several sections (configs/task/: ``# @package _global_``);
# no top-level key of their own, none chosen by default.
PRESET_GROUPS = ("task",)


# Keys renamed when the RL phase stopped being named after GRPO (old -> new). A user's old key
# is one line naming the new one; a run's saved config.yaml is read with the new names.
RENAMED_KEYS = {"trainer.grpo_steps": "trainer.rl_steps", "algo.grpo": "algo.actor", "algo.ppo": "algo.critic"}
# verl's keys for what one key does here (data.max_prompt_length is the same in both): the
# unknown-key line names ours.
VERL_EQUIVALENTS = {
    "data.filter_overlong_prompts": "data.overlong=filter (the default: prompts over data.max_prompt_length are "
                                    "dropped and counted)",
    "data.truncation": "data.overlong=error (verl's truncation=error) or data.overlong=truncate (verl's "
                       "truncation=left: keep the last tokens)",
}


def _renamed_prefix(key: str) -> str | None:
    """The renamed key that dotted ``key`` (``+``/``~`` already stripped) is or lies under."""
    return next((old for old in RENAMED_KEYS if key == old or key.startswith(old + ".")), None)


def renamed_to(key: str) -> str | None:
    """Dotted ``key`` (an override's, ``+``/``~`` allowed) under its new name when it is or lies
    under a renamed key, else None."""
    key = key.lstrip("+~")
    old = _renamed_prefix(key)
    return None if old is None else RENAMED_KEYS[old] + key[len(old):]


def renamed_key(key: str) -> str | None:
    """``"OLD was renamed NEW"`` when dotted ``key`` is or lies under a renamed key, else None."""
    key = key.lstrip("+~")
    old = _renamed_prefix(key)
    if old is None:
        return None
    return f"{old} was renamed {RENAMED_KEYS[old]}" + (f" ({renamed_to(key)})" if key != old else "")


def upgrade_saved_config(raw: dict) -> dict:
    """A saved config (a run's config.yaml) with the renamed keys under their new names."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for old, new in RENAMED_KEYS.items():
        (group, old_leaf), new_leaf = old.split("."), new.split(".")[1]
        section = raw.get(group)
        if isinstance(section, dict) and old_leaf in section and new_leaf not in section:
            section[new_leaf] = section.pop(old_leaf)
    return raw


def _keys(node, prefix: str = "") -> list[str]:
    """Every leaf key of a composed config, dotted."""
    out = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        out.extend(_keys(value, key + ".") if isinstance(value, DictConfig) else [key])
    return out


def _keys_without(key: str, overrides: list[str]) -> list[str] | None:
    """Every key of the config the overrides other than ``key``'s compose; None when another
    override is wrong too (then no suggestion is made)."""
    others = [o for o in overrides if o.lstrip("+~").partition("=")[0] != key]
    try:
        return _keys(compose(others))
    except ConfigError:
        return None


def _did_you_mean(key: str, known: list[str] | None) -> str:
    """'did you mean X?' for an unknown ``key`` among the ``known`` keys: the same leaf name
    under the key's own section (``algo.actor.lr`` -> ``algo.actor.optim.lr``), else the closest
    spelling; '' if none is close (or ``known`` is None)."""
    import difflib

    if known is None:
        return ""
    section, _, leaf = key.rpartition(".")
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    nested = [k for k in same_leaf if k.startswith(section + ".")] if section else []
    close = nested or difflib.get_close_matches(key, known, n=1, cutoff=0.8) or same_leaf[:1]
    return f"did you mean {close[0]}?" if close else ""


def _hydra_error(exc: Exception, overrides: list[str]) -> ConfigError:
    """One line from a Hydra/OmegaConf composition error."""
    from hydra.errors import MissingConfigException

    text = str(exc)
    if isinstance(exc, MissingConfigException):
        match = re.search(r"Could not find '([^/']+)/([^']+)'", text)
        if match:
            group, option = match.groups()
            options = ", ".join(available_options(group))
            return ConfigError(f"{group}={option}: no such option; choose one of {options}")
    match = re.search(r"Could not override '([^']+)'", text)
    if match and "not in struct" in f"{text} {exc.__cause__}":
        key = match.group(1)
        known = _keys_without(key, overrides)
        if renamed_key(key):
            # The old name may have been wrong too (algo.grpo.lr): then the new one is unknown.
            new_key = renamed_to(key)
            unknown_too = new_key != RENAMED_KEYS.get(key.lstrip("+~")) and known is not None and new_key not in known
            hint = _did_you_mean(new_key, known) if unknown_too else ""
            return ConfigError(f"{key}: {renamed_key(key)}" + (f", which is unknown too; {hint}" if hint else ""))
        if key.lstrip("+~") in VERL_EQUIVALENTS:
            return ConfigError(f"{key}: verl's key; here it is {VERL_EQUIVALENTS[key.lstrip('+~')]}")
        hint = _did_you_mean(key, known)
        return ConfigError(f"{key}: unknown key; {hint or 'check the spelling'} "
                           f"(`polyfsdp-train --cfg` prints every key)")
    cause = exc.__cause__
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if cause is not None and str(cause).strip():
        first = f"{first} ({str(cause).strip().splitlines()[0]})"
    return ConfigError(first)


def available_options(group: str) -> list[str]:
    """The option names of a config group (the YAML files in ``configs/<group>/``)."""
    from importlib.resources import files

    root = files(CONFIG_MODULE).joinpath(group)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


# ``${if_model_path:A,B}`` in the shipped YAML: A when model.path names a checkpoint (a pretrained
# model: the values peers use for one), B for the built-in model built from a preset (the values
# tuned for the default job's 0.23M-parameter model). A key the user sets wins either way.
MODEL_PATH_RESOLVER = "if_model_path"


def _if_model_path(when_path, otherwise, *, _root_):
    return when_path if _root_.model.get("path") else otherwise


# ``${required:}``: a key a preset needs the user to set (data=jsonl's data.path). OmegaConf's
# ``???`` cannot say it over a declared default: merging ``???`` onto a value keeps the value.
REQUIRED_RESOLVER = "required"


def _required(*, _node_):
    from omegaconf.errors import MissingMandatoryValue

    raise MissingMandatoryValue(f"Missing mandatory value: {_node_._get_full_key(None)}")


def register_resolvers() -> None:
    """The shipped YAML's resolvers (idempotent)."""
    if not OmegaConf.has_resolver(MODEL_PATH_RESOLVER):
        OmegaConf.register_new_resolver(MODEL_PATH_RESOLVER, _if_model_path)
    if not OmegaConf.has_resolver(REQUIRED_RESOLVER):
        OmegaConf.register_new_resolver(REQUIRED_RESOLVER, _required)


# Hydra's ConfigStore holds each group's declared defaults as the option ``base``
# (configs/<group>/*.yaml start with ``defaults: [base, _self_]``) and an optional sub-section's
# as ``schema/<path>`` (configs/algo/grpo.yaml: ``/schema/algo/actor@actor``). Plain dicts, not
# OmegaConf structured configs: OmegaConf 2.3 refuses Union fields other than Optional
# (``data.train_files: list | str | None``, ``rollout.unshard: bool | str``), and the declared
# types and ranges are checked by one converter anyway (trainer/config/bounds.py).
BASE_OPTION = "base"


def register_declared_defaults() -> None:
    """Store every group's and optional sub-section's declared defaults (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from .bounds import defaults_of
    from .reference import group_sections, optional_sections

    store = ConfigStore.instance()
    for group, cls in group_sections().items():
        store.store(group=group, name=BASE_OPTION, node=defaults_of(cls))
    for path, cls in optional_sections().items():
        *parents, leaf = path.split(".")
        store.store(group="/".join(["schema", *parents]), name=leaf, node=defaults_of(cls))


def compose(overrides: list[str]) -> DictConfig:
    """Compose ``train.yaml`` with ``overrides``; Hydra's errors become one-line ConfigErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()
    register_declared_defaults()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise _hydra_error(exc, list(overrides)) from None
    except ValueError as exc:
        # Hydra raises a plain ValueError, naming no key, for a group set to null (engine=null).
        for item in overrides:
            key, _, value = item.partition("=")
            if key in GROUPS and value.strip() == "null":
                raise ConfigError(f"{item}: a config group needs an option; choose one of "
                                  f"{', '.join(available_options(key))}") from None
        raise ConfigError(" ".join(str(exc).split()) or type(exc).__name__) from None
    finally:
        GlobalHydra.instance().clear()


def to_container(cfg: DictConfig) -> dict:
    """Resolve interpolations into a plain dict; a missing mandatory value is a ConfigError."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        if key and "Missing mandatory value" in str(exc):
            raise ConfigError(f"{key}: a value is required (set {key}=...)") from None
        raise ConfigError(str(exc).strip().splitlines()[0]) from None
