"""The engine's canonical batch: every sequence's tokens packed into one flat row + offsets.

Converted once at the edge from the caller's layout (``no_padding`` jagged or
``left_right`` dense) and back again for outputs. The sequence lengths are read to the
host once, here, so nothing downstream (micro-batch planning, attention, outputs) needs
another device-to-host read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from .. import jagged
from .images import IMAGE_KEYS, ImageInputs, images_from_batch

STRUCTURAL_KEYS = ("input_ids", "attention_mask", "position_ids")


@dataclass
class FlatBatch:
    """``input_ids (total,)`` and ``offsets (B+1,)`` with the host copy ``seq_lens`` of the
    lengths; per-token ``fields`` flat like ``input_ids``; per-sequence ``seq_fields``
    ``(B, ...)``; ``temperature``: one float, or one value per sequence ``(B,)``; ``scored``: the
    positions whose head outputs are read, a host bool ``(total,)`` (None: every position;
    engines/head/rows.py), which stays on the host when the batch moves; ``images``: a
    vision-language batch's per-sequence pixel inputs (engines/batch/images.py), or None."""

    input_ids: torch.Tensor
    offsets: torch.Tensor
    seq_lens: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    temperature: float | torch.Tensor = 1.0
    scored: torch.Tensor | None = None
    images: ImageInputs | None = None

    @property
    def num_seqs(self) -> int:
        """Number of sequences B."""
        return len(self.seq_lens)

    @property
    def total(self) -> int:
        """Number of real tokens (known on the host from the values' shape)."""
        return self.input_ids.shape[0]

    @property
    def max_len(self) -> int:
        """The longest sequence's length (host)."""
        return max(self.seq_lens, default=0)

    @property
    def min_len(self) -> int:
        """The shortest sequence's length (host)."""
        return min(self.seq_lens, default=0)

    @property
    def lengths(self) -> torch.Tensor:
        """Per-sequence lengths ``(B,)`` on the batch's device."""
        return self.offsets[1:] - self.offsets[:-1]

    def set_temperature(self, temperature) -> None:
        """Set the caller's temperature: a finite float > 0 or a ``(B,)`` tensor (its values are
        checked at the edge with the others, engines/batch/checks.py)."""
        if torch.is_tensor(temperature):
            if temperature.shape != (self.num_seqs,):
                raise ValueError(f"temperature: expected a float or a ({self.num_seqs},) tensor, "
                                 f"got shape {tuple(temperature.shape)}")
            self.temperature = temperature.to(dtype=torch.float32)
        elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or not math.isfinite(temperature):
            raise ValueError(f"temperature: expected a float > 0 (finite) or a (B,) tensor, got {temperature!r}")
        else:
            self.temperature = float(temperature)

    def token_temperature(self) -> float | torch.Tensor:
        """The temperature as the forward wants it: a float, or one value per token ``(total,)``."""
        if not torch.is_tensor(self.temperature):
            return self.temperature
        return torch.repeat_interleave(self.temperature, self.lengths, output_size=self.total)

    def to(self, device: torch.device) -> "FlatBatch":
        """The same batch with every tensor on ``device`` (host lengths stay on the host)."""
        def move(t):
            return t.to(device, non_blocking=True) if torch.is_tensor(t) else t
        return FlatBatch(move(self.input_ids), move(self.offsets), self.seq_lens,
                         {k: move(v) for k, v in self.fields.items()},
                         {k: move(v) for k, v in self.seq_fields.items()}, move(self.temperature), self.scored,
                         None if self.images is None else self.images.to(device))


def _check_jagged(name: str, value) -> None:
    if not (torch.is_tensor(value) and value.is_nested and value.layout == torch.jagged):
        given = f"{value.layout} tensor {tuple(value.shape)}" if torch.is_tensor(value) and not value.is_nested \
            else type(value).__name__
        raise TypeError(f"pad_mode='no_padding': batch[{name!r}] must be a jagged nested tensor "
                        f"(layout=torch.jagged), got {given}")


def _caller_ids(batch: TensorDict, pad_mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids`` as a contiguous jagged tensor, and the left_right attention mask (or None)."""
    if "input_ids" not in batch.keys():
        raise ValueError(f"batch has no 'input_ids' (keys: {sorted(batch.keys())})")
    if pad_mode == "no_padding":
        nt = batch["input_ids"]
        _check_jagged("input_ids", nt)
        attention_mask = None
    elif pad_mode == "left_right":
        if "attention_mask" not in batch.keys():
            raise ValueError("pad_mode='left_right' needs batch['attention_mask'] (B, L) next to input_ids")
        dense, attention_mask = batch["input_ids"], batch["attention_mask"]
        if dense.is_nested or dense.dim() != 2 or attention_mask.shape != dense.shape:
            raise ValueError(f"pad_mode='left_right': input_ids and attention_mask must be dense (B, L) of one "
                             f"shape, got {tuple(dense.shape)} and {tuple(attention_mask.shape)}")
        nt = jagged.left_right_to_jagged(dense, attention_mask)
    else:
        raise ValueError(f"pad_mode: got {pad_mode!r}; allowed values: 'no_padding', 'left_right'")
    return (nt.contiguous() if nt.lengths() is not None else nt), attention_mask


def batch_to_flat(batch: TensorDict, pad_mode: str, keys=None) -> FlatBatch:
    """Convert a caller's batch into a :class:`FlatBatch`; ``keys`` limits which extra fields
    come along (default: every tensor field besides the structural ones)."""
    nt, attention_mask = _caller_ids(batch, pad_mode)
    offsets = jagged.offsets(nt)
    # The one read of the lengths to the host (a no-op copy for host batches).
    flat = FlatBatch(nt.values(), offsets, offsets.diff().tolist())
    flat.images = images_from_batch(batch, flat.num_seqs)
    names = [k for k in batch.keys() if k not in STRUCTURAL_KEYS + IMAGE_KEYS] if keys is None else list(keys)
    bsz = flat.num_seqs
    for name in names:
        value = batch[name]
        if not torch.is_tensor(value):
            continue
        if pad_mode == "no_padding" and value.is_nested:
            _check_jagged(name, value)
            if value.lengths() is not None:
                value = value.contiguous()
            value_offsets = jagged.offsets(value)
            if value_offsets.shape != offsets.shape or not torch.equal(value_offsets, offsets):
                raise ValueError(f"batch[{name!r}]: its offsets {value_offsets.tolist()} differ from "
                                 f"input_ids' {offsets.tolist()}; per-token fields must share input_ids' layout")
            flat.fields[name] = value.values()
        elif pad_mode == "left_right" and value.dim() == 2 and value.shape == batch["input_ids"].shape:
            flat.fields[name] = jagged.left_right_to_flat(value, attention_mask, total=flat.total)[0]
        elif not value.is_nested and value.dim() >= 1 and value.shape[0] == bsz and \
                not (pad_mode == "left_right" and value.dim() == 2):
            flat.seq_fields[name] = value
        else:
            expected = "a jagged tensor like input_ids or a (B,) tensor" if pad_mode == "no_padding" \
                else f"a dense {tuple(batch['input_ids'].shape)} tensor like input_ids or a (B,) tensor"
            raise ValueError(f"batch[{name!r}]: expected {expected}, got shape {tuple(value.shape)}")
    return flat


def flat_to_caller(values: torch.Tensor, flat: FlatBatch, batch: TensorDict, pad_mode: str) -> torch.Tensor:
    """Per-token ``values (total,)`` back in the caller's layout: jagged with the input's
    offsets for ``no_padding``, dense zero-padded and aligned with ``input_ids`` for ``left_right``."""
    if pad_mode == "no_padding":
        # Host-known bounds: make_jagged would otherwise read accelerator offsets back (a sync).
        return jagged.make_jagged(values, flat.offsets, min_seqlen=flat.min_len, max_seqlen=flat.max_len)
    return jagged.flat_to_left_right(values, flat.offsets, batch["attention_mask"].to(values.device))
