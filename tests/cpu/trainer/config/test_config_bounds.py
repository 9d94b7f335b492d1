"""Every number of the job config has a range: NaN, infinities and absurd sizes are one
ConfigError naming the key, before anything is built (trainer/config/bounds.py)."""
from __future__ import annotations

import copy
import dataclasses
import typing

import pytest

from polyfsdp.engines.config import EngineConfig, LoraConfig, OptimConfig
from polyfsdp.trainer.config.algo import ActorSection, CriticSection, RolloutCorrectionSection, SFTSection
from polyfsdp.trainer.config.composition import compose, to_container
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.config.sections import (DataSection, ModelSection, RewardModelSection, RewardSection,
                                              TrainerSection)
from polyfsdp.trainer.config.job import build_job_config
from polyfsdp.trainer.config.bounds import BOUNDS, bounds_for

# Where each section of the config lives; algo.critic.* exists under algo=ppo.
SECTIONS = [(TrainerSection, "trainer"), (DataSection, "data"), (ModelSection, "model"), (LoraConfig, "model.lora"),
            (RewardSection, "reward"), (RewardModelSection, "reward.model"), (EngineConfig, "engine"),
            (SFTSection, "algo.sft"), (OptimConfig, "algo.sft.optim"), (ActorSection, "algo.actor"), (OptimConfig, "algo.actor.optim"),
            (RolloutCorrectionSection, "algo.rollout_correction"), (CriticSection, "algo.critic"),
            (OptimConfig, "algo.critic.optim")]


def _is_number(hint) -> bool:
    options = typing.get_args(hint) or (hint,)
    return any(option in (int, float) for option in options)


def numeric_keys() -> list[str]:
    """Every int or float key of the shipped config (null defaults included), from the sections' type hints."""
    keys = []
    for cls, prefix in SECTIONS:
        hints = typing.get_type_hints(cls)
        keys += [f"{prefix}.{f.name}" for f in dataclasses.fields(cls) if _is_number(hints[f.name])]
    return keys


BASE = {"grpo": to_container(compose([])), "ppo": to_container(compose(["algo=ppo"]))}
BAD_VALUES = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 10**12, -10**12]


def _with(key: str, value):
    raw = copy.deepcopy(BASE["ppo" if key.startswith("algo.critic") else "grpo"])
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node[part]
    node[leaf] = value
    return raw


def test_the_key_list_covers_the_sections():
    keys = numeric_keys()
    assert len(keys) > 40
    for key in ("algo.actor.entropy_coef", "algo.actor.kl_coef", "model.lora.alpha", "trainer.seed",
                "trainer.cpu_threads", "algo.actor.temperature", "model.lora.rank", "algo.sft.optim.lr",
                "algo.actor.group_size", "trainer.prompts_per_step", "algo.actor.max_new_tokens",
                "trainer.sft_batch_size", "reward.timeout_s", "trainer.dist_timeout_s"):
        assert key in keys


@pytest.mark.parametrize("key", numeric_keys())
def test_every_numeric_key_refuses_non_finite_and_huge_values(key):
    build_job_config(_with(key, None) if key.endswith(("mini_batch_size", "tis_cap", "dual_clip_c")) else
                     copy.deepcopy(BASE["ppo" if key.startswith("algo.critic") else "grpo"]))
    for value in BAD_VALUES:
        with pytest.raises(ConfigError) as info:
            build_job_config(_with(key, value))
        message = str(info.value)
        assert message.startswith(f"{key}:") and "\n" not in message, (value, message)


@pytest.mark.parametrize("override,expected", [
    ("model.lora.alpha=1e12", "model.lora.alpha: expected at most 65536, got 1e+12"),
    ("trainer.seed=20000000000", "trainer.seed: expected at most 4294967295, got 20000000000"),
    ("trainer.cpu_threads=1000000000000", "trainer.cpu_threads: expected at most 4096"),
    ("algo.actor.temperature=inf", "algo.actor.temperature: expected a finite number, got inf"),
    ("model.lora.rank=1000000000000", "model.lora.rank: expected at most 65536"),
    ("algo.sft.optim.lr=1e30", "algo.sft.optim.lr: expected at most 1, got 1e+30"),
    ("algo.actor.group_size=1000000000000", "algo.actor.group_size: expected at most 65536"),
    ("algo.actor.entropy_coef=nan", "algo.actor.entropy_coef: expected a finite number, got nan"),
    ("algo.actor.kl_coef=-inf", "algo.actor.kl_coef: expected a finite number, got -inf"),
])
def test_the_reported_values_are_refused_by_the_command_line(override, expected):
    raw = to_container(compose([override]))
    with pytest.raises(ConfigError, match="^" + expected.replace("+", r"\+")):
        build_job_config(raw)


def test_the_ends_of_each_range_are_accepted():
    for pattern, low, high in BOUNDS:
        key = pattern.replace("*", "actor" if pattern.startswith("algo") else "trainer")
        if key not in numeric_keys():
            continue
        for end in (low, high):
            if end is None:
                continue
            if key == "algo.actor.mini_batch_size":
                continue  # must also divide prompts_per_step: checked by the section
            raw = _with(key, end)
            if key in ("trainer.prompts_per_step", "trainer.sft_batch_size"):
                raw["algo"]["actor"]["mini_batch_size"] = None
            if key == "data.min_len":
                raw["data"]["max_len"] = end
            if key == "data.max_len":
                raw["data"]["min_len"] = min(raw["data"]["min_len"], end)
            build_job_config(raw)  # no ConfigError
    assert bounds_for("model.seed") == (0, 2**32 - 1)
