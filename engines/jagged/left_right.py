"""The ``left_right`` layout: dense ``(B, L, *rest)`` rows whose real tokens are where
``attention_mask`` is 1 (left-padded prompt + right-padded response), to and from flat values.

Same synchronisation rule as ``engines/jagged/``: a host mask is validated; an accelerator
mask is trusted when ``total`` is given and read back once when it is not.
"""
from __future__ import annotations

import torch

from . import checks
from .kernels import gather_rows, offsets_from_lengths, packed, scatter_rows, to_device, wrap


def _check_mask(dense: torch.Tensor, mask, name: str) -> None:
    checks.check_tensor(mask, "attention_mask")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(dense.shape[:2]):
        raise ValueError(f"attention_mask must have shape (B, L) = {tuple(dense.shape[:2])} matching {name}; got {tuple(mask.shape)}")


def _validate_mask_host(mask: torch.Tensor) -> None:
    bad = ((mask != 0) & (mask != 1)).nonzero()
    if bad.numel():
        i, t = (int(x) for x in bad[0])
        raise ValueError(f"attention_mask must hold only 0 and 1; got attention_mask[{i}, {t}] = {mask[i, t].item()}")
    on = (mask != 0).to(torch.int8)
    runs = on[:, 0] + (on[:, 1:] > on[:, :-1]).sum(1) if on.shape[1] else on.sum(1)
    broken = (runs > 1).nonzero()
    if broken.numel():
        i = int(broken[0, 0])
        raise ValueError(
            f"attention_mask rows must be one contiguous run of ones (left-padded prompt + right-padded response); "
            f"row {i} has {int(runs[i])} runs"
        )


def _mask_layout(mask: torch.Tensor, total: int | None):
    """Return (row_starts, lengths, offsets, total, min_len, max_len) on the mask's device."""
    B, L = mask.shape
    checks.check_total(total)
    if not checks.on_host(mask) and total is None:
        checks.note_sync("attention_mask")
        host = mask.cpu()
    else:
        host = mask if checks.on_host(mask) else None
    if host is not None:
        _validate_mask_host(host)
    on = (mask != 0).to(torch.int8)
    lens = on.sum(1, dtype=torch.int64)
    # First 1 of each row (0 for an empty row, where nothing is gathered anyway).
    first = on.argmax(1) if L else torch.zeros(B, dtype=torch.int64, device=mask.device)
    row_starts = torch.arange(B, device=mask.device) * L + first
    offs = offsets_from_lengths(lens)
    if host is not None:
        host_lens = (host != 0).sum(1, dtype=torch.int64)
        host_total = int(host_lens.sum())
        if total is not None and total != host_total:
            raise ValueError(f"total must equal attention_mask.sum() = {host_total}; got total={total}")
        lo, hi = checks.seqlen_bounds(host_lens)
        return row_starts, lens, offs, host_total, lo, hi
    return row_starts, lens, offs, total, 0, L


def left_right_to_flat(dense: torch.Tensor, attention_mask: torch.Tensor, *,
                       total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``left_right`` padded ``(B, L, *rest)`` -> (values of the real tokens, int64 offsets).

    A row's real tokens are where ``attention_mask`` is 1: one contiguous run (validated
    when the mask is on the host or ``total`` is not given; trusted otherwise).
    """
    checks.check_dense(dense, "input_ids")
    _check_mask(dense, attention_mask, "input_ids")
    row_starts, lens, offs, total, _, _ = _mask_layout(attention_mask, total)
    dev = dense.device
    offs = to_device(offs, dev)
    return gather_rows(dense, to_device(row_starts, dev), to_device(lens, dev), offs, total), offs


def left_right_to_jagged(input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                         total: int | None = None) -> torch.Tensor:
    """``left_right`` padded ``(B, L, *rest)`` -> jagged nested ``(B, j, *rest)`` of the real tokens."""
    checks.check_dense(input_ids, "input_ids")
    _check_mask(input_ids, attention_mask, "input_ids")
    row_starts, lens, offs, total, lo, hi = _mask_layout(attention_mask, total)
    dev = input_ids.device
    offs = to_device(offs, dev)
    values = gather_rows(input_ids, to_device(row_starts, dev), to_device(lens, dev), offs, total)
    return wrap(values, offs, lo, hi)


def flat_to_left_right(values: torch.Tensor, offsets: torch.Tensor, attention_mask: torch.Tensor,
                       padding_value=0) -> torch.Tensor:
    """Flat ``values`` + ``offsets`` -> ``(B, L, *rest)`` with each sequence where its mask row is 1.

    The inverse of :func:`left_right_to_flat`: per-token outputs (log-probs, entropy) come
    back aligned with ``input_ids``. Host inputs are checked for matching lengths.
    """
    checks.check_tensor(values, "values")
    checks.check_index_vector(offsets, "offsets")
    checks.check_tensor(attention_mask, "attention_mask")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != offsets.numel() - 1:
        raise ValueError(
            f"attention_mask must have shape (B, L) with B = {offsets.numel() - 1} sequences; got {tuple(attention_mask.shape)}"
        )
    offsets = offsets.to(torch.int64)
    if checks.on_host(offsets):
        checks.validate_offsets_host(offsets, values.shape[0])
    mask_total = values.shape[0] if not checks.on_host(attention_mask) else None
    row_starts, mask_lens, _, _, _, _ = _mask_layout(attention_mask, mask_total)
    if checks.on_host(offsets) and checks.on_host(attention_mask):
        seq_lens = offsets.diff()
        diff = (seq_lens != mask_lens).nonzero()
        if diff.numel():
            i = int(diff[0, 0])
            raise ValueError(
                f"sequence {i} has {int(seq_lens[i])} tokens but attention_mask row {i} has {int(mask_lens[i])} ones"
            )
    dev = values.device
    offsets = to_device(offsets, dev)
    B, L = attention_mask.shape
    return scatter_rows(values, to_device(row_starts, dev), offsets.diff(), offsets, B, L, padding_value)


def jagged_to_left_right(nt: torch.Tensor, attention_mask: torch.Tensor, padding_value=0) -> torch.Tensor:
    """Jagged nested ``(B, j, *rest)`` -> ``left_right`` padded ``(B, L, *rest)`` following ``attention_mask``."""
    checks.check_jagged(nt)
    values, offs = packed(nt)
    return flat_to_left_right(values, offs, attention_mask, padding_value)
