"""Numerical check of a patch: the patched module against its original forward on a small random input.

Tolerance (stated, per dtype): a patch passes when ``max|patched - original| <= atol + rtol * max|original|``
with fp32: atol 1e-5, rtol 1e-4; bf16: atol 1.6e-2, rtol 1.6e-2; fp16: atol 2e-3, rtol 2e-3.
Fused kernels reorder reductions, so exact equality is not expected; a wrong kernel is off by O(1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}


@dataclass
class ProbeCase:
    """One module call used for verification; ``make_inputs`` returns (args, kwargs) and must give the
    same tensors each call (it is called before and after the patch)."""

    label: str
    module: nn.Module
    make_inputs: Callable[[], tuple[tuple, dict]]


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for outputs of this dtype."""
    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])


def _first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"verification expects a tensor or a tuple starting with one, got {type(output).__name__}")


def capture(cases: list[ProbeCase]) -> list[torch.Tensor]:
    """Run every case once without gradients, in eval mode (dropout off), and keep the outputs."""
    outputs = []
    for case in cases:
        was_training = case.module.training
        case.module.eval()
        try:
            with torch.no_grad():
                args, kwargs = case.make_inputs()
                outputs.append(_first_tensor(case.module(*args, **kwargs)).detach().clone())
        finally:
            case.module.train(was_training)
    return outputs


def compare(cases: list[ProbeCase], originals: list[torch.Tensor], patched: list[torch.Tensor]) -> str | None:
    """None when every case is within tolerance, else a reason naming the case and the max error."""
    for case, ref, out in zip(cases, originals, patched):
        if ref.shape != out.shape:
            return f"verification ({case.label}): shape {tuple(out.shape)} != original {tuple(ref.shape)}"
        err = (out.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
        atol, rtol = tolerance(ref.dtype)
        limit = atol + rtol * (ref.float().abs().max().item() if ref.numel() else 0.0)
        if not err <= limit:  # also catches NaN
            return f"verification ({case.label}): max abs error {err:.3g} > tolerance {limit:.3g} ({ref.dtype})"
    return None
