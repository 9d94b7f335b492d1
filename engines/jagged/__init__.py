"""Jagged batches: the one place that converts between padded and variable-length layouts.

Canonical form: flat ``values (total_nnz, *rest)`` plus ``offsets (B + 1,)`` int64, or the
same wrapped as a jagged nested tensor ``(B, j, *rest)`` with ``min_seqlen``/``max_seqlen``
set (without them ``to_padded_tensor`` pads to the TOTAL length).

Synchronisation rule: nothing here reads an accelerator tensor back to the host when the
host already knows the sizes. Lengths/offsets/masks that live on the host are validated
(clear ``ValueError`` naming the rule and the index); ones that live on an accelerator are
trusted when ``total`` is given (validating them would need a host-device sync), and read
back once, then validated, when it is not.

This module holds right padding and the nested-tensor accessors; its ``__all__`` is the whole
public API, with the ``left_right`` conversions (left_right.py), next-token labels (labels.py)
and the index kernels (kernels.py; checks in checks.py) it imports.
"""
from __future__ import annotations

import torch

from . import checks
from .checks import SIDES
from .kernels import (
    flat_index,
    offsets_from_lengths,
    pack_right_padded,
    packed,
    positions_in_sequences,
    to_device,
    unpack_to_padded,
    wrap,
)
from .left_right import flat_to_left_right, jagged_to_left_right, left_right_to_flat, left_right_to_jagged
from .labels import IGNORE_INDEX, next_token_labels, next_token_labels_flat

__all__ = [
    "IGNORE_INDEX",
    "SIDES",
    "dense_to_flat",
    "dense_to_jagged",
    "flat_index",
    "flat_to_dense",
    "flat_to_left_right",
    "jagged_to_dense",
    "jagged_to_left_right",
    "left_right_to_flat",
    "left_right_to_jagged",
    "lengths",
    "make_jagged",
    "next_token_labels",
    "next_token_labels_flat",
    "offsets",
    "positions_in_sequences",
]


def make_jagged(values: torch.Tensor, offsets: torch.Tensor, *, min_seqlen: int | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
    """Wrap ``values (total, *rest)`` and ``offsets (B+1,)`` as a jagged nested tensor.

    Offsets must be 1-D integer, on ``values``' device, start at 0, be non-decreasing and end
    at ``values.shape[0]``; a broken rule raises ``ValueError`` naming it and the index.
    Accelerator offsets are read back (one sync) unless both seqlen bounds are given.
    """
    checks.check_values(values)
    checks.check_index_vector(offsets, "offsets")
    if offsets.device != values.device:
        raise ValueError(f"offsets must be on values' device {values.device}; got {offsets.device}")
    offsets = offsets.to(torch.int64)
    if checks.on_host(offsets) or min_seqlen is None or max_seqlen is None:
        host = offsets if checks.on_host(offsets) else offsets.cpu()
        checks.validate_offsets_host(host, values.shape[0])
        lo, hi = checks.seqlen_bounds(host.diff())
        min_seqlen = lo if min_seqlen is None else min_seqlen
        max_seqlen = hi if max_seqlen is None else max_seqlen
    return wrap(values, offsets, min_seqlen, max_seqlen)


def offsets(nt: torch.Tensor) -> torch.Tensor:
    """``(B + 1,)`` int64 offsets of a jagged nested tensor (of its packed values)."""
    checks.check_jagged(nt)
    if nt.lengths() is not None:
        return offsets_from_lengths(nt.lengths().to(torch.int64))
    return nt.offsets().to(torch.int64)


def lengths(nt: torch.Tensor) -> torch.Tensor:
    """``(B,)`` int64 sequence lengths of a jagged nested tensor."""
    checks.check_jagged(nt)
    if nt.lengths() is not None:
        return nt.lengths().to(torch.int64)
    return nt.offsets().diff().to(torch.int64)


def _resolve_sizes(dense: torch.Tensor, lengths_arg, offsets_arg, total: int | None):
    """Return (lengths, offsets, total, min_len, max_len, host lengths list or None), tensors on dense's device."""
    B, L = dense.shape[:2]
    if (lengths_arg is None) == (offsets_arg is None):
        raise ValueError("give exactly one of lengths (B,) or offsets= (B + 1,)")
    checks.check_total(total)
    if lengths_arg is not None:
        checks.check_index_vector(lengths_arg, "lengths")
        if lengths_arg.numel() != B:
            hint = " (to pass offsets use offsets=)" if lengths_arg.numel() == B + 1 else ""
            raise ValueError(f"lengths must have B = {B} elements; got {lengths_arg.numel()}{hint}")
        src = lens = lengths_arg.to(torch.int64)
    else:
        checks.check_index_vector(offsets_arg, "offsets")
        if offsets_arg.numel() != B + 1:
            raise ValueError(f"offsets must have B + 1 = {B + 1} elements; got {offsets_arg.numel()}")
        src = offsets_arg.to(torch.int64)
    host = checks.on_host(src)
    if not host and total is None:
        checks.note_sync("lengths" if lengths_arg is not None else "offsets")
        src, host = src.cpu(), True
    if host:
        if lengths_arg is not None:
            lens = src
        else:
            checks.validate_offsets_host(src, int(src[-1]))
            lens = src.diff()
        # One host read gives the validity check, the seqlen bounds and the total (C
        # builtins over B ints); the search for the offending index runs only on failure.
        host_lens = lens.tolist()
        lo, hi = (min(host_lens), max(host_lens)) if host_lens else (0, 0)
        if lo < 0 or hi > L:
            checks.validate_lengths_host(lens, L, name="lengths" if lengths_arg is not None else "offsets.diff()")
        offs = offsets_from_lengths(lens) if lengths_arg is not None else src
        host_total = sum(host_lens)
        if total is not None and total != host_total:
            raise ValueError(f"total must equal the sum of lengths = {host_total}; got total={total}")
        dev = dense.device
        return to_device(lens, dev), to_device(offs, dev), host_total, lo, hi, host_lens
    # Accelerator sizes with a host total: trusted, and the seqlen bounds are (0, L).
    if lengths_arg is not None:
        offs = offsets_from_lengths(lens)
    else:
        offs, lens = src, src.diff()
    dev = dense.device
    return to_device(lens, dev), to_device(offs, dev), total, 0, L, None


def dense_to_flat(dense: torch.Tensor, lengths: torch.Tensor | None = None, total: int | None = None, *,
                  offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, L, *rest)`` -> (contiguous ``values (total, *rest)``, int64 ``offsets (B+1,)``).

    Give ``lengths (B,)`` or ``offsets=(B+1,)``. Host sizes are validated (0 <= length <= L);
    accelerator sizes need ``total=`` to stay sync-free and are then trusted. Differentiable.
    """
    checks.check_dense(dense)
    lens, offs, total, _, _, host_lens = _resolve_sizes(dense, lengths, offsets, total)
    return pack_right_padded(dense, lens, offs, total, host_lens), offs


def dense_to_jagged(dense: torch.Tensor, lengths: torch.Tensor | None = None, *, offsets: torch.Tensor | None = None,
                    total: int | None = None) -> torch.Tensor:
    """Right-padded ``(B, L, *rest)`` -> jagged nested ``(B, j, *rest)`` with contiguous values.

    Same inputs and rules as :func:`dense_to_flat`. No Python loop over the batch and no
    host-device sync when the sizes are on the host or ``total`` is given; with accelerator
    sizes the seqlen bounds are set to (0, L).
    """
    checks.check_dense(dense)
    lens, offs, total, lo, hi, host_lens = _resolve_sizes(dense, lengths, offsets, total)
    return wrap(pack_right_padded(dense, lens, offs, total, host_lens), offs, lo, hi)


def flat_to_dense(values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value=0,
                  side: str = "right") -> torch.Tensor:
    """Flat ``values (total, *rest)`` + ``offsets (B+1,)`` -> padded ``(B, max_len, *rest)``.

    ``side="left"`` puts each sequence at the end of its row. Host offsets are validated
    (including every length <= max_len); accelerator offsets are trusted. Differentiable.
    """
    checks.check_values(values)
    checks.check_index_vector(offsets, "offsets")
    checks.check_side(side)
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int; got {max_len!r}")
    offsets = offsets.to(torch.int64)
    if checks.on_host(offsets):
        checks.validate_offsets_host(offsets, values.shape[0])
        checks.validate_lengths_host(offsets.diff(), max_len, name="offsets.diff()")
    return unpack_to_padded(values, to_device(offsets, values.device), max_len, padding_value, side)


def jagged_to_dense(nt: torch.Tensor, padding_value=0, side: str = "right", length: int | None = None) -> torch.Tensor:
    """Jagged nested ``(B, j, *rest)`` -> padded ``(B, L, *rest)``.

    ``L`` is ``length`` when given (must be >= the longest sequence), else ``max_seqlen``.
    ``side="left"`` right-aligns every sequence.
    """
    checks.check_jagged(nt)
    checks.check_side(side)
    values, offs = packed(nt)
    longest = nt._max_seqlen
    if length is None:
        length = int(longest)
    elif not isinstance(length, int) or isinstance(length, bool) or length < int(longest):
        raise ValueError(f"length must be an int >= the longest sequence ({int(longest)}); got {length!r}")
    return flat_to_dense(values, offs, length, padding_value, side)
