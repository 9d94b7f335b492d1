"""Ulysses sequence parallelism for the log-prob forward (docs/architecture.md, "Sequence parallelism").

Every rank of a sequence-parallel (SP) group holds the same micro-batch. Its rows (the packed
``(1, total)`` row, or the right-padded ``(B, L)`` rows) are built whole, with next-token
labels shifted BEFORE the split (a label at a shard boundary is the first token of the next
shard), padded to a multiple of ``sp`` and cut into ``sp`` contiguous column shards. Each
rank runs the model on its shard (attention: engines/attention/ulysses.py) and the fused or
unfused head (a critic: its value head) on its shard's hidden states only; the per-token
results are all-gathered (with gradients flowing back to their owners) into the flat
``(total,)`` layout.

Gradients: each SP rank computes the loss of the whole micro-batch from the gathered
log-probs, with the engine's global counts counting that micro-batch once per SP rank, so
the ranks' loss shares and metrics still sum to the step's values and each token's gradient
reaches its shard exactly once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from polyfsdp.backends.distributed import all_gather_differentiable, all_gather_object_in
from polyfsdp.backends.topology import Topology
from polyfsdp.backends.base import HOST_CU_SEQ_LENS

from .. import jagged
from ..batch.flat import FlatBatch
from ..head.forward import FUSED_HEAD_METHOD, FusedHeadCall, logprob_entropy_from_logits
from ..jagged import IGNORE_INDEX
from ..attention.ulysses import SP_KWARG, UlyssesContext, install_ulysses
from ..head.rows import KeptRows, shard_kept_rows
from ..head.value import VALUE_HEAD_METHOD
from .fsdp import vision_tower

logger = logging.getLogger(__name__)


@dataclass
class SequenceParallel:
    """This rank's SP group, its size and the rank's place in it."""

    group: object
    size: int
    rank: int


def setup_sequence_parallel(model: torch.nn.Module, topo: Topology) -> SequenceParallel | None:
    """This rank's SP group in ``topo`` (None for sp = 1), with Ulysses attention installed
    on ``model``. Call on every rank, before FSDP wraps the model."""
    if topo.sp_size == 1:
        return None
    if vision_tower(model) is not None:
        # Splitting a packed row would cut images and their four-row mrope positions across ranks.
        raise ValueError(f"ulysses_sp_size={topo.sp_size}: sequence parallelism does not support vision-language "
                         f"models yet ({type(model).__name__}); use ulysses_sp_size=1")
    install_ulysses(model, topo.sp_size)
    logger.debug("Ulysses sequence parallelism: sp=%d, dp=%d", topo.sp_size, topo.dp_size)
    return SequenceParallel(topo.sp_group, topo.sp_size, topo.sp_rank)


def check_same_batch(flat: FlatBatch, sp: SequenceParallel) -> None:
    """Refuse SP ranks holding different batches (their shards would belong to different rows)."""
    lengths = all_gather_object_in(flat.seq_lens, sp.group)
    if any(other != lengths[0] for other in lengths):
        raise ValueError(f"ulysses_sp_size={sp.size}: the ranks of one sequence-parallel group must pass the "
                         f"same batch; their sequence lengths differ ({lengths[0]} vs "
                         f"{next(o for o in lengths if o != lengths[0])})")


@dataclass
class Rows:
    """Whole model rows ``(R, W)`` with ``W`` a multiple of sp, labels shifted globally."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    temperature: float | torch.Tensor  # float, or (R, W)
    attention_kwargs: dict


def _padded_width(width: int, sp: int) -> int:
    return max(-(-width // sp), 1) * sp


def packed_rows(flat: FlatBatch, labels: torch.Tensor, temperature, sp: int) -> Rows:
    """One ``(1, W)`` row; the padding is a sequence of its own, so no real token sees it."""
    width = _padded_width(flat.total, sp)
    pad = width - flat.total
    device = flat.input_ids.device

    def padded(values: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([values, values.new_full((pad,), fill)]).unsqueeze(0)

    positions = torch.cat([jagged.positions_in_sequences(flat.offsets, flat.total),
                           torch.arange(pad, device=device)]).unsqueeze(0)
    host_cu = [0]
    for n in flat.seq_lens:
        host_cu.append(host_cu[-1] + n)
    if pad:
        host_cu.append(width)
    cu = torch.tensor(host_cu, dtype=torch.int32).to(device, non_blocking=True)
    longest = max(flat.max_len, pad)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
              HOST_CU_SEQ_LENS: host_cu}
    temps = padded(temperature, 1.0) if torch.is_tensor(temperature) else temperature
    return Rows(padded(flat.input_ids, 0), positions, padded(labels, IGNORE_INDEX), temps, kwargs)


def padded_rows(flat: FlatBatch, labels: torch.Tensor, temperature, sp: int) -> Rows:
    """Right-padded ``(B, W)`` rows. No mask: with right padding, causal attention never lets
    a real token see a pad, and pads' own outputs are dropped."""
    width = _padded_width(flat.max_len, sp)

    def dense(values: torch.Tensor, fill) -> torch.Tensor:
        return jagged.flat_to_dense(values, flat.offsets, width, padding_value=fill)

    positions = torch.arange(width, device=flat.input_ids.device).expand(flat.num_seqs, width)
    temps = dense(temperature, 1.0) if torch.is_tensor(temperature) else temperature
    return Rows(dense(flat.input_ids, 0), positions, dense(labels, IGNORE_INDEX), temps, {})


@dataclass
class Shard:
    """This rank's columns of a micro-batch's rows: the model inputs (with the Ulysses
    context), the next-token labels and temperatures of its positions, and ``to_flat``,
    which all-gathers a per-position ``(R * shard,)`` result into the flat ``(total,)`` layout
    (gradients flow back to each shard's owner)."""

    inputs: dict
    labels: torch.Tensor
    temperature: float | torch.Tensor
    to_flat: object
    kept: KeptRows | None = None  # this shard's rows the head runs on (None: all of them)


def shard_rows(flat: FlatBatch, *, use_remove_padding: bool, sp: SequenceParallel) -> Shard:
    """Build ``flat``'s whole rows (labels shifted before the split), padded to a multiple of
    sp, and cut out this rank's contiguous column shard."""
    labels = jagged.next_token_labels_flat(flat.input_ids, flat.offsets, fill=IGNORE_INDEX)
    build = packed_rows if use_remove_padding else padded_rows
    rows = build(flat, labels, flat.token_temperature(), sp.size)
    num_rows, width = rows.input_ids.shape
    shard = width // sp.size
    cols = slice(sp.rank * shard, (sp.rank + 1) * shard)
    inputs = {"input_ids": rows.input_ids[:, cols], "position_ids": rows.position_ids[:, cols],
              SP_KWARG: UlyssesContext(sp.group, sp.size, rows.attention_kwargs)}
    temperature = rows.temperature[:, cols].reshape(-1) if torch.is_tensor(rows.temperature) else rows.temperature

    def to_flat(local: torch.Tensor) -> torch.Tensor:
        # (sp, R, shard) -> (R, W): shard i holds columns [i * shard, (i + 1) * shard).
        whole = all_gather_differentiable(local.reshape(num_rows, shard), sp.group)
        whole = whole.permute(1, 0, 2).reshape(num_rows, width)
        if use_remove_padding:
            return whole[0, :flat.total]
        return jagged.dense_to_flat(whole, offsets=flat.offsets, total=flat.total)[0]

    return Shard(inputs, rows.labels[:, cols].reshape(-1), temperature, to_flat,
                 shard_kept_rows(_scored_rows(flat, width, use_remove_padding), cols, flat.input_ids.device))


def _scored_rows(flat: FlatBatch, width: int, use_remove_padding: bool) -> torch.Tensor | None:
    """``flat.scored`` (host) in the rows layout ``(R, width)``; padding is never scored."""
    if flat.scored is None:
        return None
    if use_remove_padding:
        return torch.cat([flat.scored, flat.scored.new_zeros(width - flat.total)]).unsqueeze(0)
    host_offsets = jagged.offsets_from_lengths(torch.tensor(flat.seq_lens, dtype=torch.long))
    return jagged.flat_to_dense(flat.scored, host_offsets, width, padding_value=False)


def sp_forward_logprobs(model, flat: FlatBatch, *, use_remove_padding: bool, fused: bool, softcap: float | None,
                        return_entropy: bool, sp: SequenceParallel, fused_impl: tuple[str, bool] = ("eager", False)
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward_logprobs.forward_logprobs` with the rows split over the SP group:
    per-token ``(log_probs, entropy)`` flat ``(total,)``, the same on every rank of the group."""
    if flat.total == 0:
        empty = flat.input_ids.new_zeros(0, dtype=torch.float32)
        return empty, (empty if return_entropy else None)
    part = shard_rows(flat, use_remove_padding=use_remove_padding, sp=sp)
    if fused:
        call = FusedHeadCall(to_flat=lambda h: h.reshape(-1, h.shape[-1]), temperature=part.temperature,
                             return_entropy=return_entropy, softcap=softcap, impl=fused_impl[0],
                             compile_fallback=fused_impl[1], kept=part.kept)
        log_probs, entropy = getattr(model, FUSED_HEAD_METHOD)(part.inputs, part.labels, call)
    else:
        logits = model(**part.inputs, use_cache=False).logits
        kept, labels, temperature = part.kept, part.labels, part.temperature
        if kept is None:
            logits = logits.reshape(-1, logits.shape[-1])
        else:
            logits = kept.from_grid(logits)
            labels, temperature = kept.take(labels, temperature)
        log_probs, entropy = logprob_entropy_from_logits(logits, labels, temperature, return_entropy=return_entropy,
                                                         ignore_index=IGNORE_INDEX, check_values=False)
        if kept is not None:
            log_probs, entropy = kept.scatter(log_probs, entropy)
    return part.to_flat(log_probs), (part.to_flat(entropy) if return_entropy else None)


def sp_forward_values(model, flat: FlatBatch, *, use_remove_padding: bool, sp: SequenceParallel) -> torch.Tensor:
    """A critic's :func:`value_head.forward_values` with the rows split over the SP group:
    per-token values flat ``(total,)`` (last position of each sequence 0), the same on every
    rank of the group. The value head runs on this rank's hidden states only."""
    if flat.total == 0:
        return flat.input_ids.new_zeros(0, dtype=torch.float32)
    part = shard_rows(flat, use_remove_padding=use_remove_padding, sp=sp)
    local = getattr(model, VALUE_HEAD_METHOD)(part.inputs, lambda h: h.reshape(-1, h.shape[-1]))[:, 0]
    # A position without a next token (a sequence's last, or padding) has no state to value.
    local = torch.where(part.labels != IGNORE_INDEX, local.float(),
                        torch.zeros((), dtype=torch.float32, device=local.device))
    return part.to_flat(local)
