"""Defaults follow the model: with ``model.path`` (a pretrained checkpoint) the learning rates,
the KL and the entropy bonus are those peers use for one (TRL's and verl's GRPO lr 1e-6, verl's
kl 0.001 and entropy 0); the built-in model keeps the values tuned for it. What the user or a task
preset sets wins either way, and the saved config holds the values the run used."""
from __future__ import annotations

import pytest

from polyfsdp.trainer.config.composition import compose, to_container

KEYS = {"sft_lr": ("algo", "sft", "optim", "lr"), "actor_lr": ("algo", "actor", "optim", "lr"),
        "kl_coef": ("algo", "actor", "kl_coef"), "entropy_coef": ("algo", "actor", "entropy_coef")}
PRETRAINED = {"sft_lr": 1e-5, "actor_lr": 1e-6, "kl_coef": 0.001, "entropy_coef": 0.0}
BUILTIN = {"sft_lr": 3e-3, "actor_lr": 1e-3, "kl_coef": 0.01, "entropy_coef": 0.01}


def _values(*overrides: str) -> dict:
    """The KEYS an algo has (algo=sft: the SFT phase's only)."""
    raw = to_container(compose(list(overrides)))
    out = {}
    for name, path in KEYS.items():
        node = raw
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[name] = node
    return out


@pytest.mark.parametrize("algo", ["grpo", "ppo", "sft"])
def test_a_model_path_takes_the_pretrained_defaults(algo):
    keys = ["sft_lr"] if algo == "sft" else list(KEYS)
    assert _values(f"algo={algo}") == {k: BUILTIN[k] for k in keys}
    assert _values(f"algo={algo}", "model.path=/models/any") == {k: PRETRAINED[k] for k in keys}


def test_the_critic_follows_the_model_too():
    critic = lambda *o: to_container(compose(["algo=ppo", *o]))["algo"]["critic"]["optim"]["lr"]  # noqa: E731
    assert (critic(), critic("model.path=/models/any")) == (1e-3, 1e-5)


def test_what_the_user_or_a_task_sets_wins():
    assert _values("model.path=/m", "algo.actor.optim.lr=1e-5")["actor_lr"] == 1e-5
    assert _values("algo.actor.kl_coef=0.2")["kl_coef"] == 0.2
    # task=calculator tunes the built-in model's RL lr: a preset is the user's choice too.
    assert _values("task=calculator", "model.path=/m")["actor_lr"] == 1e-4
