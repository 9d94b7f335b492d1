"""Build a LossInputs from per-sequence lists, for loss tests (CPU and device suites)."""
from __future__ import annotations

from typing import Sequence

import torch

from polyfsdp.engines.losses.inputs import LossInputs


def loss_inputs_from_sequences(
    log_probs: Sequence[Sequence[float] | torch.Tensor],
    fields: dict[str, Sequence[Sequence[float] | torch.Tensor]] | None = None,
    entropy: Sequence[Sequence[float] | torch.Tensor] | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: int | None = None,
    mask_field: str = "response_mask",
) -> LossInputs:
    """Flat LossInputs of one micro-batch; the global counts default to this batch's own
    (the number of tokens where ``mask_field`` is 1, or all tokens without it, and the
    number of sequences)."""

    def flat(seqs, dtype=torch.float32):
        parts = [torch.as_tensor(s, dtype=dtype) if not torch.is_tensor(s) else s for s in seqs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

    lengths = torch.tensor([len(s) for s in log_probs], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    flat_fields = {name: flat(seqs) for name, seqs in (fields or {}).items()}
    if global_num_tokens is None:
        mask = flat_fields.get(mask_field)
        global_num_tokens = float(mask.sum()) if mask is not None else float(offsets[-1])
    if global_num_seqs is None:
        global_num_seqs = len(log_probs)
    return LossInputs(log_probs=flat(log_probs), entropy=flat(entropy) if entropy is not None else None,
                      fields=flat_fields, offsets=offsets, global_num_tokens=global_num_tokens,
                      global_num_seqs=global_num_seqs)
