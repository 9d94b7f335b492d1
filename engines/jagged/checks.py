"""Input checks for the jagged conversions, and the host half of their synchronisation rule.

Sizes that live on the host are validated (``ValueError`` naming the rule and the index);
sizes on an accelerator are trusted when the caller gives ``total``, and otherwise read
back once (:func:`note_sync`) and then validated. Shared by ``jagged``, ``jagged_left_right``
and ``labels``; tests fake an accelerator by replacing :func:`on_host` here.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

SIDES = ("right", "left")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_warned_sync = False


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` can be read without a host-device synchronisation."""
    return t.is_cpu


def check_tensor(t, name: str) -> None:
    """``t`` must be a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")


def check_index_vector(t, name: str) -> None:
    """``t`` must be a 1-D integer tensor (lengths or offsets)."""
    check_tensor(t, name)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(t.shape)}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype; got {t.dtype}")


def check_values(values) -> None:
    """``values`` must be a dense ``(total, *rest)`` tensor."""
    check_tensor(values, "values")
    if values.is_nested or values.dim() < 1:
        raise ValueError(f"values must be a dense tensor of shape (total, *rest); got shape {tuple(values.shape)}")


def check_dense(dense, name: str = "dense") -> None:
    """``dense`` must be a padded ``(B, L, *rest)`` tensor."""
    check_tensor(dense, name)
    if dense.is_nested:
        raise TypeError(f"{name} must be a dense (padded) tensor; got a nested tensor")
    if dense.dim() < 2:
        raise ValueError(f"{name} must have shape (B, L, *rest); got shape {tuple(dense.shape)}")


def check_jagged(nt, name: str = "nt") -> None:
    """``nt`` must be a jagged nested tensor, ragged in dim 1."""
    check_tensor(nt, name)
    if not nt.is_nested or nt.layout != torch.jagged:
        raise TypeError(f"{name} must be a jagged nested tensor (layout=torch.jagged); got layout {nt.layout}, is_nested={nt.is_nested}")
    if nt._ragged_idx != 1:
        raise ValueError(f"{name} must be ragged in dim 1; got ragged dim {nt._ragged_idx}")


def check_side(side: str) -> None:
    """``side`` must name a padding side."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}; got {side!r}")


def check_total(total) -> None:
    """``total``, when given, must be a non-negative int."""
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise ValueError(f"total must be a non-negative int; got {total!r}")


def validate_offsets_host(offsets: torch.Tensor, total: int, name: str = "offsets") -> None:
    """Check offset values on the host: start at 0, non-decreasing, end at ``total``."""
    if offsets.numel() == 0:
        raise ValueError(f"{name} must have B + 1 >= 1 elements; got an empty tensor")
    first = int(offsets[0])
    if first != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {first}")
    drops = (offsets[1:] < offsets[:-1]).nonzero()
    if drops.numel():
        i = int(drops[0, 0]) + 1
        raise ValueError(
            f"{name} must be non-decreasing; got {name}[{i}] = {int(offsets[i])} < {name}[{i - 1}] = {int(offsets[i - 1])}"
        )
    last = int(offsets[-1])
    if last != total:
        raise ValueError(
            f"{name} must end at values.shape[0] = {total}; got {name}[{offsets.numel() - 1}] = {last}"
        )


def validate_lengths_host(lengths: torch.Tensor, max_len: int, name: str = "lengths") -> None:
    """Check every host length lies in ``[0, max_len]``."""
    bad = ((lengths < 0) | (lengths > max_len)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"{name} must lie in [0, L={max_len}]; got {name}[{i}] = {int(lengths[i])}")


def seqlen_bounds(lengths_host: torch.Tensor) -> tuple[int, int]:
    """(shortest, longest) of host lengths; (0, 0) for an empty batch."""
    if lengths_host.numel() == 0:
        return 0, 0
    lo, hi = torch.aminmax(lengths_host)
    return int(lo), int(hi)


def note_sync(what: str) -> None:
    """Log, once per process, that accelerator sizes are being read back."""
    global _warned_sync
    if not _warned_sync:
        _warned_sync = True
        logger.info("%s lives on an accelerator and total= was not given: reading it back once (pass total= to stay sync-free)", what)
