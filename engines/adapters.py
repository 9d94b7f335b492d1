"""Model-input adapters, one per remove-padding mode, and their output adapters.

Each turns a :class:`FlatBatch` into the keyword arguments of the HF model and turns
any per-position model output (logits, hidden states) back into flat ``(total, ...)``.
"""
from __future__ import annotations

import torch

from . import jagged
from .flat_batch import FlatBatch


class PackedAdapter:
    """remove-padding: one ``(1, total)`` row, position ids restarting per sequence, and the
    ``cu_seq_lens`` keywords varlen attention kernels read."""

    name = "rmpad"

    def model_inputs(self, flat: FlatBatch) -> dict:
        """Keyword arguments for the model's forward."""
        total, offsets = flat.total, flat.offsets
        position_ids = jagged.positions_in_sequences(offsets, total)
        cu = offsets.to(torch.int32)
        return {
            "input_ids": flat.input_ids.unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": flat.max_len,
            "max_length_k": flat.max_len,
        }

    def to_flat(self, output: torch.Tensor, flat: FlatBatch) -> torch.Tensor:
        """``(1, total, ...)`` -> ``(total, ...)``."""
        return output[0]


class PaddedAdapter:
    """No remove-padding: right-padded ``(B, L)`` with an attention mask."""

    name = "padded"

    def model_inputs(self, flat: FlatBatch) -> dict:
        """Keyword arguments for the model's forward."""
        length = max(flat.max_len, 1)
        input_ids = jagged.flat_to_dense(flat.input_ids, flat.offsets, length, padding_value=0)
        positions = torch.arange(length, device=flat.offsets.device)
        attention_mask = (positions[None, :] < flat.lengths[:, None]).to(torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def to_flat(self, output: torch.Tensor, flat: FlatBatch) -> torch.Tensor:
        """``(B, L, ...)`` -> ``(total, ...)``, keeping only real tokens."""
        values, _ = jagged.dense_to_flat(output, flat.lengths, flat.total)
        return values


def input_adapter(use_remove_padding: bool):
    """The adapter for a remove-padding setting."""
    return PackedAdapter() if use_remove_padding else PaddedAdapter()
