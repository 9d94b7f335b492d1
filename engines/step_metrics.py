"""The loss and its metrics between two optimizer steps (docs/architecture.md, "Contracts").

Each micro-batch's loss and metrics are 0-d device tensors: shares of the step's global counts,
summed over micro-batches and batches, except names ending in ``_max`` (``ratio_max``,
``rollout_mismatch_abs_max``, ``dp_token_imbalance_*_max``), which are maxima. At the optimizer
step they are reduced over ranks the same way and come to the host with the gradient norm in
one read.
"""
from __future__ import annotations

import torch

from polyfsdp.backends.distributed import all_gather_object, all_reduce_max, all_reduce_sum

# Loss metrics whose name ends with this are maxima: combined by max over micro-batches,
# batches and ranks instead of summed.
MAX_SUFFIX = "_max"


def _combine(key: str, total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """Accumulate one metric: a sum of shares, or a maximum for ``*_max`` keys."""
    if total is None:
        return value
    return torch.maximum(total, value) if key.endswith(MAX_SUFFIX) else total + value


def accumulate(totals: dict[str, torch.Tensor], metrics: dict, device: torch.device) -> None:
    """Add ``metrics`` (tensors or floats) into ``totals`` in place, as float64 device tensors."""
    for key, value in metrics.items():
        value = torch.as_tensor(value).detach().to(device=device, dtype=torch.float64)
        totals[key] = _combine(key, totals.get(key), value)


def reduce_over_ranks(pending: dict[str, torch.Tensor], device: torch.device) -> tuple[list[str], torch.Tensor]:
    """``(names, values)`` of every rank's metrics (a rank that ran only placeholder micro-batches
    has none, and counts 0 for each), the sums reduced by sum and the maxima (of non-negative
    values) by max over ranks; ``values`` is one float64 device tensor in ``names``' order."""
    keys = sorted(set().union(*all_gather_object(sorted(pending))))
    names, values = [], []
    for maxima, reduce in ((False, all_reduce_sum), (True, all_reduce_max)):
        group = [k for k in keys if k.endswith(MAX_SUFFIX) == maxima]
        if not group:
            continue
        stacked = torch.stack([pending.get(k, torch.zeros((), dtype=torch.float64, device=device)) for k in group])
        reduce(stacked)
        names += group
        values.append(stacked)
    return names, torch.cat(values) if values else torch.zeros(0, dtype=torch.float64, device=device)
