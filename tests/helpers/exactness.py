"""The suite's two kinds of numeric comparison (docs/testing.md, "Exactness"):

- the same computation repeated (a resume, a seed, rank counts where promised, a replay): bit for bit,
  with ``==`` / ``torch.equal``, nothing here;
- two formulations of the same math (a rewritten loss, a fused path against an unfused one, a user
  estimator against the built-in): equal to float32 rounding, with the tolerance below. Which way the
  rounding of two formulations falls depends on the CPU's kernels (AVX-512, AVX2, no SIMD), so an exact
  comparison of two formulations passes on one machine and fails on another.

The tolerance is float32's: ``FORMULATION_ULPS`` units in the last place of the larger value, and the
same number of ulps of 1.0 as an absolute floor, for values that are differences of terms of about
1 (a loss, an advantage) and may cancel to near 0. 128 ulps leaves room for the rounding of a few
optimizer steps over a tiny model (seen: 1 ulp after two RL updates, AVX-512 against AVX2) and is
still 1.5e-5 relative: a wrong sign, a missing term or a mask off by one token is orders above it.
"""
from __future__ import annotations

import math
from typing import Any

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23: one ulp of 1.0
FORMULATION_ULPS = 128
FORMULATION_RTOL = FORMULATION_ULPS * FLOAT32_EPS
FORMULATION_ATOL = FORMULATION_ULPS * FLOAT32_EPS


def floats_agree(a: float, b: float) -> bool:
    """Two floats from two formulations agree to float32 rounding (NaN agrees with NaN, inf only with itself)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=FORMULATION_RTOL, abs_tol=FORMULATION_ATOL)


def _differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, (str, type(None))) \
            or isinstance(b, (str, type(None))):
        return [] if a == b else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, int) and isinstance(b, int):  # counts, steps, token totals: exact
        return [] if a == b else [f"{where}: {a} != {b}"]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return [] if floats_agree(float(a), float(b)) else [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys differ: {sorted(set(a) ^ set(b))}"]
        return [d for key in a for d in _differences(a[key], b[key], f"{where}[{key!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def assert_formulations_agree(a: Any, b: Any, what: str = "records") -> None:
    """Records (dicts, lists, numbers, strings) of two formulations: strings, bools and ints exactly,
    floats to float32 rounding. The message lists every difference."""
    differences = _differences(a, b, what)
    assert not differences, f"{len(differences)} difference(s) beyond float32 rounding " \
                            f"({FORMULATION_ULPS} ulps):\n" + "\n".join(differences[:40])


def assert_tensors_agree(a: torch.Tensor, b: torch.Tensor) -> None:
    """Tensors of two formulations, in float32 or wider: equal to float32 rounding (same shape and dtype)."""
    torch.testing.assert_close(a, b, rtol=FORMULATION_RTOL, atol=FORMULATION_ATOL)
