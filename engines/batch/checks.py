"""Value checks of a batch, run once per batch at the engine's edge, in ONE host read.

Each check reduces its tensor to a device scalar (a count of bad entries); :meth:`read`
brings all of them to the host in a single transfer, together with any other values the
step needs there (the step's global token and sequence counts: ``read_global_counts``). Only
when a count is non-zero does the slow path run, to name the field and the first bad position.
On an accelerator every extra ``.item()``/``bool()`` is a pipeline stall, so nothing else in
the hot loop reads values.
"""
from __future__ import annotations

from typing import Callable

import torch

from polyfsdp.backends.distributed import all_reduce_sum

from .flat import FlatBatch


def check_integer_ids(ids: torch.Tensor) -> None:
    """Token ids must be an integer tensor (a dtype check: no read of the values)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor; got {ids.dtype}")


def describe_position(flat_index: int, offsets: torch.Tensor) -> str:
    """``flat index i (sequence s, position t)`` for a flat token index."""
    off = offsets.cpu()
    seq = int(torch.searchsorted(off, torch.tensor(flat_index), right=True)) - 1
    return f"flat index {flat_index} (sequence {seq}, position {flat_index - int(off[seq])})"


class BatchChecks:
    """Collects value checks and reads them (plus extra values) to the host at once."""

    def __init__(self) -> None:
        self._counts: list[torch.Tensor] = []
        self._explain: list[Callable[[], Exception]] = []

    def add(self, bad_count: torch.Tensor, explain: Callable[[], Exception]) -> None:
        """Register a check: ``bad_count`` (0-d) > 0 means failure; ``explain()`` builds the error."""
        self._counts.append(bad_count.reshape(1).to(torch.float64))
        self._explain.append(explain)

    def token_ids(self, ids: torch.Tensor, vocab_size: int) -> None:
        """Integer ids in ``[0, vocab_size)`` (else the embedding fails deep inside, or with a
        device-side assert on an accelerator)."""
        check_integer_ids(ids)
        if ids.numel() == 0:
            return

        def explain() -> Exception:
            lo, hi = (int(x) for x in torch.aminmax(ids))
            return ValueError(f"input_ids must lie in [0, {vocab_size}); got values in [{lo}, {hi}]")
        self.add(((ids < 0) | (ids >= vocab_size)).sum(), explain)

    def zero_one(self, name: str, mask: torch.Tensor, offsets: torch.Tensor) -> None:
        """A per-token mask holding only 0 and 1."""
        if mask.dtype == torch.bool or mask.numel() == 0:
            return
        bad = ~((mask == 0) | (mask == 1))

        def explain() -> Exception:
            i = int(bad.nonzero()[0, 0])
            return ValueError(f"field {name!r} must hold only 0/1 values; found {mask[i].item()!r} at "
                              f"{describe_position(i, offsets)}")
        self.add(bad.sum(), explain)

    def finite(self, name: str, values: torch.Tensor, offsets: torch.Tensor) -> None:
        """A per-token float field without NaN or infinity."""
        if not values.is_floating_point() or values.numel() == 0:
            return
        bad = ~torch.isfinite(values)

        def explain() -> Exception:
            i = int(bad.nonzero()[0, 0])
            return ValueError(f"field {name!r} must be finite; found {values[i].item()} at "
                              f"{describe_position(i, offsets)}")
        self.add(bad.sum(), explain)

    def temperatures(self, temperature: torch.Tensor) -> None:
        """Per-sequence temperatures, every one finite and > 0."""
        bad = ~((temperature > 0) & torch.isfinite(temperature))

        def explain() -> Exception:
            return ValueError(f"temperature: every value must be > 0 and finite, got {temperature.tolist()}")
        self.add(bad.sum(), explain)

    def read(self, extra: torch.Tensor | None = None) -> list[float]:
        """One device-to-host read of every check and of ``extra`` (1-D); raises the first
        failed check's error, else returns ``extra``'s values."""
        parts = self._counts + ([extra.reshape(-1).to(torch.float64)] if extra is not None else [])
        if not parts:
            return []
        values = torch.cat([p.to(parts[0].device) for p in parts]).tolist()
        for count, explain in zip(values, self._explain):
            if count:
                raise explain()
        return values[len(self._counts):]

    def loss_fields(self, flat: FlatBatch, names, mask_field: str) -> None:
        """The per-token fields a loss reads: its mask ``mask_field`` 0/1, the others finite."""
        for name in names:
            value = flat.fields.get(name)
            if value is not None and name == mask_field:
                self.zero_one(name, value, flat.offsets)
            elif value is not None:
                self.finite(name, value, flat.offsets)

    def read_global_counts(self, flat: FlatBatch, mask_field: str, device) -> tuple[float, int]:
        """Read every check and the step's (tokens, sequences) over all ranks in one go. Tokens
        are the loss's mask sum (or every position with a next token, without the mask)."""
        mask = flat.fields.get(mask_field)
        if mask is not None:
            tokens = mask.sum(dtype=torch.float64)
        else:
            tokens = torch.tensor(float(flat.total - sum(1 for n in flat.seq_lens if n > 0)), dtype=torch.float64)
        counts = torch.cat([tokens.reshape(1).to(device),
                            torch.tensor([flat.num_seqs, flat.total], dtype=torch.float64, device=device)])
        all_reduce_sum(counts)
        global_tokens, global_seqs, global_total = self.read(counts)
        if global_total == 0:
            raise ValueError("train_batch: the batch holds no tokens (every sequence is empty)")
        return global_tokens, int(global_seqs)
