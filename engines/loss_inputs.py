"""The contract between the engine's training step and a loss function.

Alignment convention (one rule for every per-token field): position ``t`` of a sequence
holds quantities about predicting token ``t + 1``, exactly like ``log_probs`` (docs/architecture.md).
So ``response_mask[t] == 1`` means "the log-prob at ``t`` belongs to the response", i.e.
``x[t + 1]`` is a response token; the last position of every sequence is always 0.
``old_log_probs``, ``ref_log_probs`` and ``advantages`` follow the same alignment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LossInputs:
    """What a loss function receives for one micro-batch.

    Per-token tensors are flat ``(total_tokens,)`` over the micro-batch's sequences in
    order; ``offsets`` (``(num_seqs + 1,)``) marks where each sequence starts. The global
    counts cover the whole step (all micro-batches, all ranks), so a loss normalised by
    them sums to the same value however the batch was split.
    """

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    fields: dict[str, torch.Tensor]
    offsets: torch.Tensor
    global_num_tokens: float
    global_num_seqs: int
    extras: dict = field(default_factory=dict)
    # A critic's per-token value predictions (same alignment); its log_probs are None.
    values: torch.Tensor | None = None


# A loss function: ``loss_fn(inputs: LossInputs) -> (loss: scalar Tensor, metrics: dict[str, Tensor])``,
# metrics as detached 0-d tensors (floats work too); the engine reads them once per optimizer step.
# It may set ``requires_entropy = False`` (attribute) so the engine skips entropy work,
# and ``required_fields = (...)`` naming the batch keys it reads (checked before the step),
# and ``mask_field`` naming the per-token mask whose sum is ``global_num_tokens``
# (default ``response_mask``; without that field, every position that has a next token).
