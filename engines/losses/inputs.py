"""The contract between the engine's training step and a loss function, and the checks of it
every log-prob loss runs (shapes only) and the declaration the fused head reads.

Alignment convention (one rule for every per-token field): position ``t`` of a sequence
holds quantities about predicting token ``t + 1``, exactly like ``log_probs`` (docs/architecture.md).
So ``response_mask[t] == 1`` means "the log-prob at ``t`` belongs to the response", i.e.
``x[t + 1]`` is a response token; the last position of every sequence is always 0.
``old_log_probs``, ``ref_log_probs`` and ``advantages`` follow the same alignment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

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
# (default ``response_mask``; without that field, every position that has a next token),
# and ``masked_positions_only = True`` (on its class) when it reads its inputs only under that
# mask (the engine then runs the LM head there alone; see reads_masked_positions_only).


def check_inputs(inputs: LossInputs, required: Sequence[str], need_entropy: bool,
                 loss_name: str = "this loss") -> None:
    """Raise ValueError for inputs of the wrong kind or shape, naming the field.

    Shape checks only: they cost no device-to-host read. Values (0/1 masks, finite fields,
    offsets) are checked once per batch at the engine's edge (engines/batch/checks.py).
    """
    if not isinstance(inputs, LossInputs):
        raise TypeError(f"loss functions take a LossInputs, got {type(inputs).__name__}")
    lp = inputs.log_probs
    if not torch.is_tensor(lp) or lp.dim() != 1 or not lp.is_floating_point():
        raise ValueError(
            f"log_probs must be a flat (total_tokens,) float tensor, got "
            f"{type(lp).__name__} {tuple(lp.shape) if torch.is_tensor(lp) else ''} "
            f"{lp.dtype if torch.is_tensor(lp) else ''}".rstrip()
        )
    offsets = inputs.offsets
    if not torch.is_tensor(offsets) or offsets.dim() != 1 or offsets.numel() < 1 or offsets.is_floating_point():
        raise ValueError(f"offsets must be a 1-D integer tensor (num_seqs + 1,), got {offsets!r}")
    missing = [name for name in required if name not in inputs.fields]
    per_seq = inputs.extras.get("seq_fields", {})
    for name in missing:
        if name in per_seq:
            raise ValueError(
                f"batch[{name!r}] has one value per sequence (shape {tuple(per_seq[name].shape)}); "
                f"{loss_name} needs it per token, in input_ids' layout (broadcast it over each sequence)"
            )
    if missing:
        raise ValueError(
            f"loss needs batch fields {list(required)}; missing {missing} (given: {sorted(inputs.fields)})"
        )
    for name in required:
        value = inputs.fields[name]
        if not torch.is_tensor(value) or value.shape != lp.shape:
            given = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(
                f"field {name!r} must have the shape of log_probs {tuple(lp.shape)} "
                f"(flat, same layout), got {given}"
            )
    if need_entropy:
        ent = inputs.entropy
        if ent is None:
            raise ValueError("this loss needs entropy (requires_entropy=True) but inputs.entropy is None")
        if ent.shape != lp.shape:
            raise ValueError(f"entropy must have the shape of log_probs {tuple(lp.shape)}, got {tuple(ent.shape)}")
    if not inputs.global_num_tokens > 0:
        raise ValueError(
            f"global_num_tokens must be > 0 (the step's response-token count), got {inputs.global_num_tokens}"
        )
    if not inputs.global_num_seqs > 0:
        raise ValueError(f"global_num_seqs must be > 0, got {inputs.global_num_seqs}")


def is_token_separable(loss_fn) -> bool:
    """Whether ``loss_fn`` declares itself token-separable: a sum over tokens of a function of
    that token's log-prob, entropy and per-token fields, with normalisers fixed before the step
    (global counts, constants), so each token's gradient needs that token alone. The fused head
    then takes the loss gradient inside its forward (engines/head/fused_loss.py). The
    declaration (``token_separable = True``) counts only on the loss's own class: a subclass may
    change ``__call__`` and must declare it again. An instance whose options break it sets
    ``self.token_separable = False`` (it may opt out, never in)."""
    return vars(type(loss_fn)).get("token_separable", False) is True and \
        getattr(loss_fn, "__dict__", {}).get("token_separable", True) is not False


def reads_masked_positions_only(loss_fn) -> bool:
    """Whether ``loss_fn`` declares ``masked_positions_only = True``: its loss and metrics read
    the log-probs, entropy and values only where its ``mask_field`` is non-zero, so the engine
    may run the LM head on those positions alone and hand it 0 elsewhere
    (engines/head/rows.py). Read on the loss's own class, as ``token_separable`` is (a
    subclass that reads more must not inherit it); an instance may opt out by setting
    ``self.masked_positions_only = False``."""
    return vars(type(loss_fn)).get("masked_positions_only", False) is True and \
        getattr(loss_fn, "__dict__", {}).get("masked_positions_only", True) is not False


@dataclass(frozen=True)
class LossNeeds:
    """What a loss declares by its attributes (the defaults above where it sets none)."""

    required: tuple[str, ...]
    entropy: bool
    mask_field: str
    masked_only: bool = False  # reads its outputs only under mask_field (reads_masked_positions_only)

    @classmethod
    def of(cls, loss_fn, batch) -> "LossNeeds":
        """Read ``loss_fn``'s attributes; a TypeError for a non-callable, a ValueError naming the
        keys it needs and ``batch`` lacks."""
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable taking LossInputs and returning (loss, metrics), such as "
                            f"SFTLoss() or PPOLoss(); got {loss_fn!r}")
        required = tuple(getattr(loss_fn, "required_fields", ()))
        missing = [k for k in required if k not in batch.keys()]
        if missing:
            raise ValueError(f"loss function {type(loss_fn).__name__} needs batch keys {list(required)}; "
                             f"missing {missing} (batch has {sorted(batch.keys())})")
        return cls(required, bool(getattr(loss_fn, "requires_entropy", True)),
                   getattr(loss_fn, "mask_field", "response_mask"), reads_masked_positions_only(loss_fn))
