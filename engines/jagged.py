"""Jagged batches: the one place that converts between padded and variable-length layouts.

Canonical form: flat ``values (total_nnz, *rest)`` plus ``offsets (B + 1,)`` int64, or the
same wrapped as a jagged nested tensor ``(B, j, *rest)`` with ``min_seqlen``/``max_seqlen``
set (without them ``to_padded_tensor`` pads to the TOTAL length).

Synchronisation rule: nothing here reads an accelerator tensor back to the host when the
host already knows the sizes. Lengths/offsets/masks that live on the host are validated
(clear ``ValueError`` naming the rule and the index); ones that live on an accelerator are
trusted when ``total`` is given (validating them would need a host-device sync), and read
back once, then validated, when it is not.

Packing strategy (measured side by side in ``benchmarks/rewrap.py``): on the host, scalar
rows ``(B, L)`` are packed with one memcpy per sequence (cat of split views) and wider rows
with torch's native padded->jagged kernel; other devices use one gather index built with
``repeat_interleave(..., output_size=total)``, which never synchronises.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label given to the last position of every sequence (the fused op's ``ignore_index``)."""

SIDES = ("right", "left")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_PAD_TO_JAGGED = torch.ops.aten._padded_dense_to_jagged_forward
_JAGGED_TO_PAD = torch.ops.aten._jagged_to_padded_dense_forward
_warned_sync = False


# ----------------------------------------------------------------------------- checks
def _on_host(t: torch.Tensor) -> bool:
    return t.is_cpu


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")


def _check_index_vector(t, name: str) -> None:
    _check_tensor(t, name)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(t.shape)}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype; got {t.dtype}")


def _check_dense(dense, name: str = "dense") -> None:
    _check_tensor(dense, name)
    if dense.is_nested:
        raise TypeError(f"{name} must be a dense (padded) tensor; got a nested tensor")
    if dense.dim() < 2:
        raise ValueError(f"{name} must have shape (B, L, *rest); got shape {tuple(dense.shape)}")


def _check_jagged(nt, name: str = "nt") -> None:
    _check_tensor(nt, name)
    if not nt.is_nested or nt.layout != torch.jagged:
        raise TypeError(f"{name} must be a jagged nested tensor (layout=torch.jagged); got layout {nt.layout}, is_nested={nt.is_nested}")
    if nt._ragged_idx != 1:
        raise ValueError(f"{name} must be ragged in dim 1; got ragged dim {nt._ragged_idx}")


def _check_side(side: str) -> None:
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}; got {side!r}")


def _validate_offsets_host(offsets: torch.Tensor, total: int, name: str = "offsets") -> None:
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


def _validate_lengths_host(lengths: torch.Tensor, max_len: int, name: str = "lengths") -> None:
    bad = ((lengths < 0) | (lengths > max_len)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"{name} must lie in [0, L={max_len}]; got {name}[{i}] = {int(lengths[i])}")


def _seqlen_bounds(lengths_host: torch.Tensor) -> tuple[int, int]:
    if lengths_host.numel() == 0:
        return 0, 0
    lo, hi = torch.aminmax(lengths_host)
    return int(lo), int(hi)


def _note_sync(what: str) -> None:
    global _warned_sync
    if not _warned_sync:
        _warned_sync = True
        logger.info("%s lives on an accelerator and total= was not given: reading it back once (pass total= to stay sync-free)", what)


def _offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    offs = lengths.new_zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offs[1:])
    return offs


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # non_blocking: a host->device copy that does not wait for the device stream.
    return t if t.device == device else t.to(device, non_blocking=True)


# ----------------------------------------------------------------------------- kernels
class _HostPack(torch.autograd.Function):
    """torch's native padded->jagged kernel, given the backward it lacks."""

    @staticmethod
    def forward(ctx, dense, offsets, total):
        ctx.save_for_backward(offsets)
        ctx.max_len = dense.shape[1]
        return _PAD_TO_JAGGED(dense, [offsets], total)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _JAGGED_TO_PAD(grad.contiguous(), [offsets], [ctx.max_len], 0.0), None, None


class _HostUnpack(torch.autograd.Function):
    """torch's native jagged->padded kernel, given the backward it lacks."""

    @staticmethod
    def forward(ctx, values, offsets, max_len, padding_value):
        ctx.save_for_backward(offsets)
        ctx.total = values.shape[0]
        return _JAGGED_TO_PAD(values, [offsets], [max_len], float(padding_value))

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _PAD_TO_JAGGED(grad.contiguous(), [offsets], ctx.total), None, None, None


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and torch.is_grad_enabled()


def flat_index(row_starts: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """For every token of a flat batch (sequence i at ``offsets[i]``, ``lengths[i]`` tokens),
    its index in another tensor where sequence i starts at ``row_starts[i]``:
    ``row_starts[i] + t`` for t < lengths[i]. ``total`` (host int) keeps it sync-free."""
    shift = row_starts - offsets[:-1]
    # output_size makes repeat_interleave skip its own device->host read of the total.
    idx = torch.repeat_interleave(shift, lengths, output_size=total)
    return idx + torch.arange(total, device=idx.device)


def positions_in_sequences(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Each flat token's position within its own sequence (restarting at 0), ``(total,)``."""
    lengths = offsets[1:] - offsets[:-1]
    return flat_index(torch.zeros_like(lengths), lengths, offsets, total)


def _gather(dense: torch.Tensor, row_starts, lengths, offsets, total: int) -> torch.Tensor:
    flat = dense.reshape(dense.shape[0] * dense.shape[1], *dense.shape[2:])
    return flat.index_select(0, flat_index(row_starts, lengths, offsets, total))


def _scatter(values, row_starts, lengths, offsets, batch: int, max_len: int, padding_value) -> torch.Tensor:
    total = values.shape[0]
    out = values.new_full((batch * max_len, *values.shape[1:]), padding_value)
    out = out.index_copy(0, flat_index(row_starts, lengths, offsets, total), values)
    return out.view(batch, max_len, *values.shape[1:])


def _pack_host_rows(dense: torch.Tensor, host_lens: list[int], total: int) -> torch.Tensor:
    """Scalar rows on the host: one memcpy per sequence (cat of split views, both in C++).

    Measured faster than the native kernel's per-element index math for (B, L) rows.
    """
    B, L = dense.shape
    if total == 0 or B == 0:
        return dense.reshape(-1)[:0].clone()
    # Alternating (kept, padding) chunk sizes, built by C-level slice assignment.
    sizes = [0] * (2 * B)
    sizes[0::2] = host_lens
    sizes[1::2] = map(L.__sub__, host_lens)
    return torch.cat(dense.reshape(-1).split_with_sizes(sizes)[0::2])


def _pack_right(dense: torch.Tensor, lengths, offsets, total: int, host_lens: list[int] | None) -> torch.Tensor:
    if _on_host(dense):
        if dense.dim() == 2 and host_lens is not None:
            return _pack_host_rows(dense, host_lens, total)
        if _needs_grad(dense):
            return _HostPack.apply(dense, offsets, total)
        return _PAD_TO_JAGGED(dense, [offsets], total)
    B, L = dense.shape[:2]
    row_starts = torch.arange(B, device=dense.device) * L
    return _gather(dense, row_starts, lengths, offsets, total)


# ----------------------------------------------------------------------------- nested
def _wrap(values: torch.Tensor, offsets: torch.Tensor, min_len: int, max_len: int) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, jagged_dim=1, min_seqlen=min_len, max_seqlen=max_len
    )


def make_jagged(values: torch.Tensor, offsets: torch.Tensor, *, min_seqlen: int | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
    """Wrap ``values (total, *rest)`` and ``offsets (B+1,)`` as a jagged nested tensor.

    Offsets must be 1-D integer, on ``values``' device, start at 0, be non-decreasing and end
    at ``values.shape[0]``; a broken rule raises ``ValueError`` naming it and the index.
    Accelerator offsets are read back (one sync) unless both seqlen bounds are given.
    """
    _check_tensor(values, "values")
    if values.is_nested or values.dim() < 1:
        raise ValueError(f"values must be a dense tensor of shape (total, *rest); got shape {tuple(values.shape)}")
    _check_index_vector(offsets, "offsets")
    if offsets.device != values.device:
        raise ValueError(f"offsets must be on values' device {values.device}; got {offsets.device}")
    offsets = offsets.to(torch.int64)
    if _on_host(offsets) or min_seqlen is None or max_seqlen is None:
        host = offsets if _on_host(offsets) else offsets.cpu()
        _validate_offsets_host(host, values.shape[0])
        lo, hi = _seqlen_bounds(host.diff())
        min_seqlen = lo if min_seqlen is None else min_seqlen
        max_seqlen = hi if max_seqlen is None else max_seqlen
    return _wrap(values, offsets, min_seqlen, max_seqlen)


def offsets(nt: torch.Tensor) -> torch.Tensor:
    """``(B + 1,)`` int64 offsets of a jagged nested tensor (of its packed values)."""
    _check_jagged(nt)
    if nt.lengths() is not None:
        return _offsets_from_lengths(nt.lengths().to(torch.int64))
    return nt.offsets().to(torch.int64)


def lengths(nt: torch.Tensor) -> torch.Tensor:
    """``(B,)`` int64 sequence lengths of a jagged nested tensor."""
    _check_jagged(nt)
    if nt.lengths() is not None:
        return nt.lengths().to(torch.int64)
    return nt.offsets().diff().to(torch.int64)


def _packed(nt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if nt.lengths() is not None:
        nt = nt.contiguous()
    return nt.values(), nt.offsets().to(torch.int64)


# ----------------------------------------------------------------------------- dense <-> flat
def _resolve_sizes(dense: torch.Tensor, lengths_arg, offsets_arg, total: int | None):
    """Return (lengths, offsets, total, min_len, max_len, host lengths list or None), tensors on dense's device."""
    B, L = dense.shape[:2]
    if (lengths_arg is None) == (offsets_arg is None):
        raise ValueError("give exactly one of lengths (B,) or offsets= (B + 1,)")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise ValueError(f"total must be a non-negative int; got {total!r}")
    if lengths_arg is not None:
        _check_index_vector(lengths_arg, "lengths")
        if lengths_arg.numel() != B:
            hint = " (to pass offsets use offsets=)" if lengths_arg.numel() == B + 1 else ""
            raise ValueError(f"lengths must have B = {B} elements; got {lengths_arg.numel()}{hint}")
        src = lens = lengths_arg.to(torch.int64)
    else:
        _check_index_vector(offsets_arg, "offsets")
        if offsets_arg.numel() != B + 1:
            raise ValueError(f"offsets must have B + 1 = {B + 1} elements; got {offsets_arg.numel()}")
        src = offsets_arg.to(torch.int64)
    host = _on_host(src)
    if not host and total is None:
        _note_sync("lengths" if lengths_arg is not None else "offsets")
        src, host = src.cpu(), True
    if host:
        if lengths_arg is not None:
            lens = src
        else:
            _validate_offsets_host(src, int(src[-1]))
            lens = src.diff()
        # One host read gives the validity check, the seqlen bounds and the total (C
        # builtins over B ints); the search for the offending index runs only on failure.
        host_lens = lens.tolist()
        lo, hi = (min(host_lens), max(host_lens)) if host_lens else (0, 0)
        if lo < 0 or hi > L:
            _validate_lengths_host(lens, L, name="lengths" if lengths_arg is not None else "offsets.diff()")
        offs = _offsets_from_lengths(lens) if lengths_arg is not None else src
        host_total = sum(host_lens)
        if total is not None and total != host_total:
            raise ValueError(f"total must equal the sum of lengths = {host_total}; got total={total}")
        dev = dense.device
        return _to(lens, dev), _to(offs, dev), host_total, lo, hi, host_lens
    # Accelerator sizes with a host total: trusted, and the seqlen bounds are (0, L).
    if lengths_arg is not None:
        offs = _offsets_from_lengths(lens)
    else:
        offs, lens = src, src.diff()
    dev = dense.device
    return _to(lens, dev), _to(offs, dev), total, 0, L, None


def dense_to_flat(dense: torch.Tensor, lengths: torch.Tensor | None = None, total: int | None = None, *,
                  offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, L, *rest)`` -> (contiguous ``values (total, *rest)``, int64 ``offsets (B+1,)``).

    Give ``lengths (B,)`` or ``offsets=(B+1,)``. Host sizes are validated (0 <= length <= L);
    accelerator sizes need ``total=`` to stay sync-free and are then trusted. Differentiable.
    """
    _check_dense(dense)
    lens, offs, total, _, _, host_lens = _resolve_sizes(dense, lengths, offsets, total)
    return _pack_right(dense, lens, offs, total, host_lens), offs


def dense_to_jagged(dense: torch.Tensor, lengths: torch.Tensor | None = None, *, offsets: torch.Tensor | None = None,
                    total: int | None = None) -> torch.Tensor:
    """Right-padded ``(B, L, *rest)`` -> jagged nested ``(B, j, *rest)`` with contiguous values.

    Same inputs and rules as :func:`dense_to_flat`. No Python loop over the batch and no
    host-device sync when the sizes are on the host or ``total`` is given; with accelerator
    sizes the seqlen bounds are set to (0, L).
    """
    _check_dense(dense)
    lens, offs, total, lo, hi, host_lens = _resolve_sizes(dense, lengths, offsets, total)
    return _wrap(_pack_right(dense, lens, offs, total, host_lens), offs, lo, hi)


def flat_to_dense(values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value=0,
                  side: str = "right") -> torch.Tensor:
    """Flat ``values (total, *rest)`` + ``offsets (B+1,)`` -> padded ``(B, max_len, *rest)``.

    ``side="left"`` puts each sequence at the end of its row. Host offsets are validated
    (including every length <= max_len); accelerator offsets are trusted. Differentiable.
    """
    _check_tensor(values, "values")
    if values.is_nested or values.dim() < 1:
        raise ValueError(f"values must be a dense tensor of shape (total, *rest); got shape {tuple(values.shape)}")
    _check_index_vector(offsets, "offsets")
    _check_side(side)
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int; got {max_len!r}")
    offsets = offsets.to(torch.int64)
    if _on_host(offsets):
        _validate_offsets_host(offsets, values.shape[0])
        _validate_lengths_host(offsets.diff(), max_len, name="offsets.diff()")
    offsets = _to(offsets, values.device)
    B = offsets.numel() - 1
    if side == "right" and _on_host(values):
        if _needs_grad(values):
            return _HostUnpack.apply(values, offsets, max_len, padding_value)
        return _JAGGED_TO_PAD(values, [offsets], [max_len], float(padding_value))
    lens = offsets.diff()
    row_starts = torch.arange(B, device=values.device) * max_len
    if side == "left":
        row_starts = row_starts + (max_len - lens)
    return _scatter(values, row_starts, lens, offsets, B, max_len, padding_value)


def jagged_to_dense(nt: torch.Tensor, padding_value=0, side: str = "right", length: int | None = None) -> torch.Tensor:
    """Jagged nested ``(B, j, *rest)`` -> padded ``(B, L, *rest)``.

    ``L`` is ``length`` when given (must be >= the longest sequence), else ``max_seqlen``.
    ``side="left"`` right-aligns every sequence.
    """
    _check_jagged(nt)
    _check_side(side)
    values, offs = _packed(nt)
    longest = nt._max_seqlen
    if length is None:
        length = int(longest)
    elif not isinstance(length, int) or isinstance(length, bool) or length < int(longest):
        raise ValueError(f"length must be an int >= the longest sequence ({int(longest)}); got {length!r}")
    return flat_to_dense(values, offs, length, padding_value, side)


# ----------------------------------------------------------------------------- left_right
def _check_mask(dense: torch.Tensor, mask, name: str) -> None:
    _check_tensor(mask, "attention_mask")
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
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise ValueError(f"total must be a non-negative int; got {total!r}")
    if not _on_host(mask) and total is None:
        _note_sync("attention_mask")
        host = mask.cpu()
    else:
        host = mask if _on_host(mask) else None
    if host is not None:
        _validate_mask_host(host)
    on = (mask != 0).to(torch.int8)
    lens = on.sum(1, dtype=torch.int64)
    # First 1 of each row (0 for an empty row, where nothing is gathered anyway).
    first = on.argmax(1) if L else torch.zeros(B, dtype=torch.int64, device=mask.device)
    row_starts = torch.arange(B, device=mask.device) * L + first
    offs = _offsets_from_lengths(lens)
    if host is not None:
        host_lens = (host != 0).sum(1, dtype=torch.int64)
        host_total = int(host_lens.sum())
        if total is not None and total != host_total:
            raise ValueError(f"total must equal attention_mask.sum() = {host_total}; got total={total}")
        lo, hi = _seqlen_bounds(host_lens)
        return row_starts, lens, offs, host_total, lo, hi
    return row_starts, lens, offs, total, 0, L


def left_right_to_flat(dense: torch.Tensor, attention_mask: torch.Tensor, *,
                       total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``left_right`` padded ``(B, L, *rest)`` -> (values of the real tokens, int64 offsets).

    A row's real tokens are where ``attention_mask`` is 1: one contiguous run (validated
    when the mask is on the host or ``total`` is not given; trusted otherwise).
    """
    _check_dense(dense, "input_ids")
    _check_mask(dense, attention_mask, "input_ids")
    row_starts, lens, offs, total, _, _ = _mask_layout(attention_mask, total)
    dev = dense.device
    return _gather(dense, _to(row_starts, dev), _to(lens, dev), _to(offs, dev), total), _to(offs, dev)


def left_right_to_jagged(input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                         total: int | None = None) -> torch.Tensor:
    """``left_right`` padded ``(B, L, *rest)`` -> jagged nested ``(B, j, *rest)`` of the real tokens."""
    _check_dense(input_ids, "input_ids")
    _check_mask(input_ids, attention_mask, "input_ids")
    row_starts, lens, offs, total, lo, hi = _mask_layout(attention_mask, total)
    dev = input_ids.device
    offs = _to(offs, dev)
    values = _gather(input_ids, _to(row_starts, dev), _to(lens, dev), offs, total)
    return _wrap(values, offs, lo, hi)


def flat_to_left_right(values: torch.Tensor, offsets: torch.Tensor, attention_mask: torch.Tensor,
                       padding_value=0) -> torch.Tensor:
    """Flat ``values`` + ``offsets`` -> ``(B, L, *rest)`` with each sequence where its mask row is 1.

    The inverse of :func:`left_right_to_flat`: per-token outputs (log-probs, entropy) come
    back aligned with ``input_ids``. Host inputs are checked for matching lengths.
    """
    _check_tensor(values, "values")
    _check_index_vector(offsets, "offsets")
    _check_tensor(attention_mask, "attention_mask")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != offsets.numel() - 1:
        raise ValueError(
            f"attention_mask must have shape (B, L) with B = {offsets.numel() - 1} sequences; got {tuple(attention_mask.shape)}"
        )
    offsets = offsets.to(torch.int64)
    if _on_host(offsets):
        _validate_offsets_host(offsets, values.shape[0])
    row_starts, mask_lens, _, _, _, _ = _mask_layout(attention_mask, values.shape[0] if not _on_host(attention_mask) else None)
    if _on_host(offsets) and _on_host(attention_mask):
        seq_lens = offsets.diff()
        diff = (seq_lens != mask_lens).nonzero()
        if diff.numel():
            i = int(diff[0, 0])
            raise ValueError(
                f"sequence {i} has {int(seq_lens[i])} tokens but attention_mask row {i} has {int(mask_lens[i])} ones"
            )
    dev = values.device
    offsets = _to(offsets, dev)
    B, L = attention_mask.shape
    return _scatter(values, _to(row_starts, dev), offsets.diff(), offsets, B, L, padding_value)


def jagged_to_left_right(nt: torch.Tensor, attention_mask: torch.Tensor, padding_value=0) -> torch.Tensor:
    """Jagged nested ``(B, j, *rest)`` -> ``left_right`` padded ``(B, L, *rest)`` following ``attention_mask``."""
    _check_jagged(nt)
    values, offs = _packed(nt)
    return flat_to_left_right(values, offs, attention_mask, padding_value)


# ----------------------------------------------------------------------------- labels
def next_token_labels_flat(values: torch.Tensor, offsets: torch.Tensor, fill=IGNORE_INDEX) -> torch.Tensor:
    """Per sequence ``label[t] = x[t + 1]``; each sequence's last position gets ``fill``.

    Works on flat ``values (total, *rest)`` + ``offsets``; never reads across a sequence
    boundary and never synchronises (empty sequences are harmless).
    """
    _check_tensor(values, "values")
    _check_index_vector(offsets, "offsets")
    total = values.shape[0]
    labels = torch.empty_like(values)
    if total == 0:
        return labels
    labels[:-1] = values[1:]
    # An empty sequence's "last" index (offsets - 1) is the previous sequence's last
    # position, or -1 -> total - 1 (the final non-empty sequence's last): filled anyway.
    last = torch.remainder(offsets[1:].to(torch.int64) - 1, total)
    return labels.index_fill_(0, _to(last, values.device), fill)


def next_token_labels(nt: torch.Tensor, pad_label=IGNORE_INDEX) -> torch.Tensor:
    """Jagged next-token labels of a jagged nested tensor (last position = ``pad_label``, default -100)."""
    _check_jagged(nt)
    values, offs = _packed(nt)
    return _wrap(next_token_labels_flat(values, offs, pad_label), offs, int(nt._min_seqlen), int(nt._max_seqlen))
