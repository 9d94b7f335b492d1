"""Every numeric key ``polyfsdp-train --cfg job`` prints (under algo=grpo and algo=ppo), each with a
wrong type, NaN, +-inf, negative and huge values (issue 38, item 8): the job's config is built in
process (no training) and then checked against this machine (check_fits); every value either
builds or is one ConfigError, a wrong type, a non-finite or a huge value never builds."""
from __future__ import annotations

import copy

import pytest

from polyfsdp.trainer.config.composition import compose, to_container
from polyfsdp.trainer.config.job import build_job_config
from polyfsdp.trainer.config.machine_fit import check_fits
from polyfsdp.trainer.errors import ConfigError

ALGOS = ("grpo", "ppo")
BASE = {algo: to_container(compose([f"algo={algo}"])) for algo in ALGOS}
# What --cfg job prints: the built config's raw mapping.
PRINTED = {algo: build_job_config(copy.deepcopy(BASE[algo])).raw for algo in ALGOS}
WRONG_TYPES = ["abc", [1], {"a": 1}, True]
NEVER_BUILD = [*WRONG_TYPES, float("nan"), float("inf"), float("-inf"), 10**12, 1e30]
MAY_BUILD = [-1, -1.5, -(10**12)]


def _numeric_paths(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numeric_paths(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path


KEYS = sorted({(algo, path) for algo in ALGOS for path in _numeric_paths(PRINTED[algo])
               if algo == "ppo" or not path.startswith("algo.critic")}, key=lambda k: (k[1], k[0]))
# Each key once: the ppo config only for what grpo lacks (the critic).
KEYS = [(algo, path) for algo, path in KEYS if algo == "grpo" or (("grpo", path) not in KEYS)]


def _with(algo: str, key: str, value):
    raw = copy.deepcopy(BASE[algo])
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node[part]
    node[leaf] = value
    return raw


def _outcome(algo: str, key: str, value) -> str | None:
    """None when the value builds and fits this machine, else the ConfigError's message."""
    try:
        check_fits(build_job_config(_with(algo, key, value)), world_size=1)
    except ConfigError as exc:
        return str(exc)
    return None


def test_the_sweep_covers_every_section_of_the_printed_config():
    paths = {path for _, path in KEYS}
    assert len(paths) > 60
    for prefix in ("trainer.", "algo.actor.", "algo.critic.", "algo.sft.optim.", "model.overrides.", "model.lora.",
                   "engine.", "data.", "reward.", "rollout.", "eval."):
        assert any(path.startswith(prefix) for path in paths), prefix


@pytest.mark.parametrize("algo,key", KEYS, ids=[key for _, key in KEYS])
def test_every_printed_numeric_key_is_one_config_error_or_builds(algo, key):
    leaf = key.rsplit(".", 1)[-1]
    for value in NEVER_BUILD + MAY_BUILD:
        message = _outcome(algo, key, value)
        if message is None:
            assert value in MAY_BUILD, f"{key}={value!r} was accepted"
            continue
        assert "\n" not in message and leaf in message, (key, value, message)


@pytest.mark.parametrize("section", ["algo.sft.optim", "algo.actor.optim"])
def test_a_negative_total_steps_is_refused_even_where_the_schedule_ignores_it(section):
    # Null by default, so not in the printed config: the sweep above never reaches it.
    message = _outcome("grpo", f"{section}.total_steps", -1)
    assert message == f"{section}.total_steps: expected an int >= 1 or None, got -1"
