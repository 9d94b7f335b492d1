"""Ranges for every number in the job configuration, checked before anything runs.

Each section's own checks cover what a value means (``group_size >= 2``, ``gamma`` in
``[0, 1]``); this module catches what they cannot foresee: NaN and infinities (which pass
every ``<`` test), and sizes so large that a run would hang, overflow a seed or allocate
without end instead of failing. Every numeric key gets a range: its entry in ``BOUNDS``
(the first pattern that matches its dotted path) or the default for its kind. The upper
ends sit far beyond any real use; docs/architecture.md ("Configuration bounds") lists them.
"""
from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Any, Iterator

from ..errors import ConfigError

# torch's generators take 64-bit seeds, and the trainer derives per-step, per-rank seeds as
# (seed * 1_000_003 + step) * 1024 + replica: a 32-bit seed keeps that inside the range (the
# per-row sampling seeds, trainer/rollout/row_seeds.py, are hashed to 63 bits whatever the parts).
MAX_SEED = 2**32 - 1
# Counts that allocate (completions, prompts, tokens per completion): far above real runs,
# low enough that a typo (1000000000000) is refused instead of hanging in generation.
MAX_GROUP_SIZE = 2**16
MAX_BATCH = 2**20
MAX_TOKENS = 2**20
# The range of a number no entry names (steps, intervals, coefficients, caps): a magnitude
# up to 1e9, whether the key is an int or a float.
MAX_MAGNITUDE = 10**9

# (dotted-path pattern, lowest, highest), first match wins; ``None``: the default's end.
BOUNDS: tuple[tuple[str, float | None, float | None], ...] = (
    ("*.seed", 0, MAX_SEED),
    ("algo.actor.group_size", None, MAX_GROUP_SIZE),
    ("algo.actor.max_new_tokens", None, MAX_TOKENS),
    ("algo.actor.mini_batch_size", None, MAX_BATCH),
    ("algo.actor.epochs", None, 1024),
    ("algo.actor.max_sample_batches", None, 1024),
    # Sampling divides logits by it: below 1e-3 float32 logits overflow, above 1e3 it is noise.
    ("algo.actor.temperature", 1e-3, 1e3),
    ("trainer.prompts_per_step", None, MAX_BATCH),
    ("trainer.sft_batch_size", None, MAX_BATCH),
    ("trainer.cpu_threads", None, 4096),
    # A peer that stays silent longer than a week is gone.
    ("trainer.dist_timeout_s", 1, 7 * 24 * 3600),
    ("reward.timeout_s", 0.001, 7 * 24 * 3600),
    # A weight beyond 1e3 carries a bounded reward (1e9) past what group statistics keep exact.
    ("reward.weight", -1e3, 1e3),
    ("reward.model.weight", -1e3, 1e3),
    ("reward.model.max_tokens_per_batch", 1, 2 ** 24),
    ("rollout.env_timeout_s", 0.001, 7 * 24 * 3600),
    ("rollout.max_turns", 1, 1024),
    ("rollout.agent_concurrency", 1, 4096),
    ("rollout.max_staleness", 0, 64),
    ("rollout.max_total_tokens", 2, 2 ** 24),
    ("data.eval_size", None, MAX_BATCH),
    ("data.max_prompt_length", None, MAX_TOKENS),
    ("data.min_len", None, 4096),
    ("data.max_len", None, 4096),
    ("model.lora.rank", None, MAX_GROUP_SIZE),
    # alpha / rank scales every adapter's output: beyond 2**16 the first step is non-finite.
    ("model.lora.alpha", None, 2**16),
    # AdamW moves each weight by about lr per step: above 1 nothing is left to train.
    ("algo.*.optim.lr", None, 1.0),
    ("algo.*.optim.eps", None, 1.0),
    # The sizes of a preset's Hugging Face config (model.overrides is otherwise free-form): the
    # config builds one entry per layer, so num_hidden_layers=10**12 hangs before any check, and a
    # size below 1 fails deep in the model's construction. The upper ends are far beyond the
    # largest open models (126 layers, hidden 16384, 256k vocabularies, 10M positions).
    ("model.overrides.num_hidden_layers", 1, 4096),
    ("model.overrides.vocab_size", 1, 2**24),
    ("model.overrides.max_position_embeddings", 1, 2**30),
    ("model.overrides.hidden_size", 1, 2**20),
    ("model.overrides.intermediate_size", 1, 2**20),
    ("model.overrides.num_attention_heads", 1, 2**20),
    ("model.overrides.num_key_value_heads", 1, 2**20),
    ("model.overrides.head_dim", 1, 2**20),
)
# Free-form mappings handed to someone else: only NaN and infinities are refused there (a
# Hugging Face config field may be anything a model needs), and the ranges BOUNDS names
# explicitly (the model's sizes).
UNBOUNDED = ("model.overrides", "reward.kwargs")


def _numbers(node: Any, path: str) -> Iterator[tuple[str, int | float]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


def bounds_for(path: str) -> tuple[float, float]:
    """The inclusive range of the number at ``path`` (its table entry, else the default)."""
    for pattern, low, high in BOUNDS:
        if fnmatchcase(path, pattern):
            return (-MAX_MAGNITUDE if low is None else low), (MAX_MAGNITUDE if high is None else high)
    return -MAX_MAGNITUDE, MAX_MAGNITUDE


def check_bounds(raw: dict) -> None:
    """ConfigError naming the first number in ``raw`` (the composed config) that is NaN,
    infinite or outside its range."""
    for path, value in _numbers(raw, ""):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value}")
        if any(path == free or path.startswith(free + ".") or path.startswith(free + "[") for free in UNBOUNDED) \
                and not any(fnmatchcase(path, pattern) and pattern.startswith(UNBOUNDED) for pattern, _, _ in BOUNDS):
            continue
        low, high = bounds_for(path)
        if not low <= value <= high:
            limit = f"at most {_show(high)}" if value > high else f"at least {_show(low)}"
            raise ConfigError(f"{path}: expected {limit}, got {_show(value)} (the bounds are in "
                              f"docs/architecture.md, Configuration bounds)")


def _show(number: float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"
