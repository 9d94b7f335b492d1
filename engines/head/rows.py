"""The head only where the loss reads it: which rows of the model's output go through the LM head.

A causal LM's head (``hidden -> vocab``) is a fifth or more of a small model's forward FLOPs
(SmolLM2-135M: 576 x 49,152 against ~110M body parameters), and an RL batch's prompt positions
carry no loss. When every consumer of a pass reads its outputs only where a mask is set (the
trainer's response mask: the built-in losses declare it, engines/losses/inputs.py), the caller
names that mask and the head runs on those rows alone; every other position reads 0, as a
position without a next token does today.

The mask travels as a host tensor (``FlatBatch.scored``) so that every index here is built on
the host, from host lengths, and reaches the device in one non-blocking copy: choosing rows
never reads a device tensor back (tests/cpu/engines/test_host_syncs.py). A mask that arrives on an
accelerator is not read: those passes keep the whole head.

:class:`KeptRows` says where the kept rows are in each layout the head sees:

- ``grid``: in the model output's rows, flattened (packed ``(1, total)``: the flat positions;
  padded ``(B, L)``: ``b * L + column``; a sequence-parallel shard: its local rows);
- ``window`` / ``window_index``: the same rows after ``logits_to_keep=window`` (the unfused path
  asks the model for those logits only);
- ``positions`` and ``total``: where their outputs go in the flat result.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..jagged.checks import on_host


@dataclass
class KeptRows:
    """The rows of one forward that go through the head (see the module docstring)."""

    positions: torch.Tensor  # (n,) long, on the device: output positions, ascending
    total: int  # length of the flat output the rows scatter into
    grid: torch.Tensor  # (n,) long, on the device: rows of the flattened model output
    window: int | torch.Tensor | None = None  # logits_to_keep for the unfused path (None: no window)
    window_index: torch.Tensor | None = None  # rows of the windowed output (None: all, in order)

    @property
    def count(self) -> int:
        """How many rows go through the head."""
        return self.positions.shape[0]

    def take(self, labels: torch.Tensor, temperature):
        """``(labels, temperature)`` at the kept rows: flat per-position ``(total,)`` labels, and a
        float temperature as it is or a per-position ``(total,)`` one."""
        kept = labels.index_select(0, self.positions)
        return kept, temperature.index_select(0, self.positions) if torch.is_tensor(temperature) else temperature

    def from_grid(self, output: torch.Tensor) -> torch.Tensor:
        """The kept rows ``(n, D)`` of a whole model output ``(..., D)``."""
        return output.reshape(-1, output.shape[-1]).index_select(0, self.grid)

    def from_window(self, output: torch.Tensor) -> torch.Tensor:
        """The kept rows ``(n, D)`` of an output computed with ``logits_to_keep=window``."""
        rows = output.reshape(-1, output.shape[-1])
        return rows if self.window_index is None else rows.index_select(0, self.window_index)

    def scatter(self, *values: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Each per-kept-row ``(n,)`` tensor (None stays None) placed in a zero ``(total,)`` tensor,
        differentiably."""
        return tuple(None if v is None else v.new_zeros(self.total).index_copy(0, self.positions, v) for v in values)


def _to_device(index: torch.Tensor, device) -> torch.Tensor:
    return index.to(device, non_blocking=True)


def kept_rows(scored: torch.Tensor | None, seq_lens: list[int], *, packed: bool, device) -> KeptRows | None:
    """The :class:`KeptRows` of a flat batch whose scored positions are ``scored`` (host bool
    ``(total,)``, or None: every row) laid out packed (one ``(1, total)`` row) or padded
    (``(B, max_len)``). None when the head should run on every row anyway (nothing to skip)."""
    total = sum(seq_lens)
    if scored is None or total == 0:
        return None
    positions = torch.nonzero(scored, as_tuple=True)[0]  # host: no device read
    if positions.shape[0] == total:
        return None
    if packed:
        grid = _to_device(positions, device)
        return KeptRows(_to_device(positions, device), total, grid, window=grid)
    lengths = torch.tensor(seq_lens, dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), lengths)[positions]
    column = positions - starts[seq]
    width = max(max(seq_lens), 1)
    # The window keeps the last ``keep`` columns of every row: from the leftmost scored column on.
    keep = width - int(column.min()) if positions.numel() else 1
    window_index = seq * keep + column - (width - keep)
    return KeptRows(_to_device(positions, device), total, _to_device(seq * width + column, device),
                    window=keep, window_index=_to_device(window_index, device))


def shard_kept_rows(scored_rows: torch.Tensor | None, columns: slice, device) -> KeptRows | None:
    """The kept rows of one sequence-parallel rank: ``scored_rows`` is the host mask in the
    rows layout ``(R, W)``; the rank holds ``columns`` of each row, flattened row-major. Its
    outputs scatter into that local ``(R * shard,)`` layout before the group's all-gather."""
    if scored_rows is None:
        return None
    local = scored_rows[:, columns].reshape(-1)
    positions = torch.nonzero(local, as_tuple=True)[0]
    if positions.shape[0] == local.shape[0]:
        return None
    index = _to_device(positions, device)
    return KeptRows(index, local.shape[0], index)


def scored_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """A caller's per-token mask as the host bool ``FlatBatch.scored``; None for a mask that
    lives on an accelerator (reading it back would stall the step: its pass keeps every row)."""
    if not on_host(mask):
        return None
    return mask != 0
