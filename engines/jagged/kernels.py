"""Packing kernels for the jagged conversions: padded rows <-> flat values, and jagged wrapping.

Strategy (measured side by side in ``benchmarks/rewrap.py``): on the host, scalar rows
``(B, L)`` are packed with one memcpy per sequence (cat of split views) and wider rows with
torch's native padded->jagged kernel; other devices use one gather index built with
``repeat_interleave(..., output_size=total)``, which never synchronises.
"""
from __future__ import annotations

import logging

import torch

from . import checks

_PAD_TO_JAGGED = torch.ops.aten._padded_dense_to_jagged_forward
_JAGGED_TO_PAD = torch.ops.aten._jagged_to_padded_dense_forward


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


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``(B + 1,)`` int64 offsets (0, then the running sum) of ``(B,)`` lengths."""
    offs = lengths.new_zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offs[1:])
    return offs


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied without waiting for the device stream when it moves."""
    return t if t.device == device else t.to(device, non_blocking=True)


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


def gather_rows(dense: torch.Tensor, row_starts, lengths, offsets, total: int) -> torch.Tensor:
    """Flat values of ``dense (B, L, *rest)``: sequence i is ``lengths[i]`` tokens from flat row ``row_starts[i]``."""
    flat = dense.reshape(dense.shape[0] * dense.shape[1], *dense.shape[2:])
    return flat.index_select(0, flat_index(row_starts, lengths, offsets, total))


def scatter_rows(values, row_starts, lengths, offsets, batch: int, max_len: int, padding_value) -> torch.Tensor:
    """The inverse of :func:`gather_rows`: ``(batch, max_len, *rest)`` filled with ``padding_value`` elsewhere."""
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


def pack_right_padded(dense: torch.Tensor, lengths, offsets, total: int, host_lens: list[int] | None) -> torch.Tensor:
    """Right-padded ``(B, L, *rest)`` -> flat values, by the fastest strategy for its device."""
    if checks.on_host(dense):
        if dense.dim() == 2 and host_lens is not None:
            return _pack_host_rows(dense, host_lens, total)
        if _needs_grad(dense):
            return _HostPack.apply(dense, offsets, total)
        return _PAD_TO_JAGGED(dense, [offsets], total)
    B, L = dense.shape[:2]
    row_starts = torch.arange(B, device=dense.device) * L
    return gather_rows(dense, row_starts, lengths, offsets, total)


def unpack_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value,
                     side: str) -> torch.Tensor:
    """Flat values -> ``(B, max_len, *rest)``, each sequence at the start (``side="right"``) or
    the end (``"left"``) of its row, by the fastest strategy for the device."""
    if side == "right" and checks.on_host(values):
        if _needs_grad(values):
            return _HostUnpack.apply(values, offsets, max_len, padding_value)
        return _JAGGED_TO_PAD(values, [offsets], [max_len], float(padding_value))
    B = offsets.numel() - 1
    lens = offsets.diff()
    row_starts = torch.arange(B, device=values.device) * max_len
    if side == "left":
        row_starts = row_starts + (max_len - lens)
    return scatter_rows(values, row_starts, lens, offsets, B, max_len, padding_value)


class _DropTorchsOwnIsFxTracingWarning(logging.Filter):
    """torch 2.13's ``nested_tensor_from_jagged`` calls its own deprecated ``torch.fx`` helper
    ``is_fx_tracing()``, which logs a deprecation warning (once per process) meant for callers of
    that helper: every user of a jagged batch saw it. Only that message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropTorchsOwnIsFxTracingWarning())


def wrap(values: torch.Tensor, offsets: torch.Tensor, min_len: int, max_len: int) -> torch.Tensor:
    """Jagged nested tensor over ``values``/``offsets`` with its seqlen bounds set (unchecked)."""
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, jagged_dim=1, min_seqlen=min_len, max_seqlen=max_len
    )


def packed(nt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(contiguous values, int64 offsets) of a jagged nested tensor."""
    if nt.lengths() is not None:
        nt = nt.contiguous()
    return nt.values(), nt.offsets().to(torch.int64)
