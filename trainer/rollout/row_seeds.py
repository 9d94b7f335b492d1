"""Sampling seeds per global sample: the seed of one completion (a row of a step's rollout)
from ``trainer.seed``, the step, the sampling round (dynamic sampling's resampling, 0 first)
and the row's index in the step's global stream (prompt index x group size + completion), so
the same prompts draw the same completions whatever the world size, the data-parallel degree
or the replica that holds them (docs/architecture.md, "Ranks, replicas and SP groups"); a
sampled evaluation's rows are seeded by their example's index in the evaluation set alike.

The parts are folded with splitmix64's finalizer, a bijection of 64-bit integers: for one
(seed, step, round) distinct rows get distinct 64-bit values; the seed is their low 63 bits
(what every generator takes as a non-negative int64), so two rows of one step share a seed
with probability about rows**2 / 2**64.
"""
from __future__ import annotations

from dataclasses import dataclass

MASK64 = (1 << 64) - 1
MASK63 = (1 << 63) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative ints, each folded in by ``splitmix64(h ^ part)``."""
    h = 0
    for part in parts:
        if part < 0:
            raise ValueError(f"mix_seed: parts must be >= 0, got {part}")
        h = _splitmix64(h ^ (part & MASK64))
    return h & MASK63


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` (a phase's step, or the global step of an evaluation), the same
    on every rank: mini-batch shuffles and evaluations draw from it."""
    return seed * 1_000_003 + step


def replica_seed(seed: int, step: int, replica: int) -> int:
    """The seed of the process generators at step ``step`` on data-parallel replica ``replica``
    (what draws besides the rollout's sampling, which is seeded per global row: LoRA's dropout);
    the ranks of one SP group draw alike (docs/architecture.md, "Ranks, replicas and SP groups")."""
    return step_seed(seed, step) * 1024 + replica


def row_seed(seed: int, step: int, sampling_round: int, row: int) -> int:
    """The sampling seed of global row ``row`` of step ``step``'s round ``sampling_round``."""
    return mix_seed(seed, step, sampling_round, row)


def eval_row_seeds(seed: int, indices: list[int], n: int) -> list[int]:
    """The seeds of a sampled evaluation's rows: ``n`` per held-out example, by its index in the
    evaluation set (``seed``: the evaluation's, from trainer.seed and the global step)."""
    return [mix_seed(seed, index * n + j) for index in indices for j in range(n)]


def turn_seed(seed: int, turn: int) -> int:
    """The seed of turn ``turn`` (1, 2, ...) of the conversation whose row seed is ``seed``."""
    return mix_seed(seed, turn)


@dataclass(frozen=True)
class RowSeeds:
    """The row seeds of one step on one replica: ``first_prompt`` is the global index (in the
    step's prompt list, and in each resampling round's) of the replica's first prompt."""

    seed: int
    step: int
    first_prompt: int = 0

    def rows(self, sampling_round: int, prompts: int, group_size: int) -> list[int]:
        """One seed per row of this replica's ``prompts`` x ``group_size`` completions."""
        start = self.first_prompt * group_size
        return [row_seed(self.seed, self.step, sampling_round, start + i) for i in range(prompts * group_size)]
