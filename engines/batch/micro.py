"""Split a FlatBatch into micro-batches under a token budget, balanced, order restorable.

Planning reads only the host lengths (``FlatBatch.seq_lens``): splitting never reads a
device tensor back.
"""
from __future__ import annotations

import heapq
import math

import torch

from .. import jagged
from .flat import FlatBatch


def _greedy(lengths: list[int], order: list[int], k: int) -> list[list[int]]:
    heap = [(0, g) for g in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + lengths[i], g))
    return groups


def plan_micro_batches(lengths: list[int], max_tokens: int | None, num_groups: int | None = None) -> list[list[int]]:
    """Group sequence indices into the fewest balanced micro-batches of <= ``max_tokens``
    tokens (longest-first greedy onto the lightest group). A sequence longer than the budget
    gets a group of its own. Each group lists its indices in increasing order.

    ``num_groups`` forces exactly that many groups (ranks must run equally many forwards
    under FSDP); groups may then be empty when there are fewer sequences than groups.
    """
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    if num_groups is not None:
        groups = [sorted(g) for g in _greedy(lengths, order, num_groups)]
        return sorted(groups, key=lambda g: (not g, g[0] if g else 0))
    total = sum(lengths)
    if max_tokens is None or total <= max_tokens or n <= 1:
        return [list(range(n))]
    k = max(1, math.ceil(total / max_tokens))
    while True:
        groups = _greedy(lengths, order, k)
        over = any(len(g) > 1 and sum(lengths[i] for i in g) > max_tokens for g in groups)
        if not over or k >= n:
            break
        k += 1
    groups = [sorted(g) for g in groups if g]
    groups.sort(key=lambda g: g[0])
    return groups


def micro_batch_sizes(lengths: list[int], max_tokens: int | None, packed: bool = True,
                      patches: list[int] | None = None) -> list[tuple[int, int, int]]:
    """``(rows, tokens, image patches)`` of each micro-batch :func:`plan_micro_batches` makes of
    sequences of ``lengths`` (``patches``: each one's image patches); unpacked rows
    (use_remove_padding=false) are padded to the longest. The memory estimate reads them."""
    sizes = []
    for group in plan_micro_batches(lengths, max_tokens):
        longest = max((lengths[i] for i in group), default=0)
        tokens = sum(lengths[i] for i in group) if packed else len(group) * longest
        sizes.append((len(group), tokens, sum(patches[i] for i in group) if patches else 0))
    return sizes


def token_index(offsets: torch.Tensor, seq_index: torch.Tensor, total: int) -> torch.Tensor:
    """Flat positions (in the full batch) of the tokens of sequences ``seq_index``, in order;
    ``total`` is their token count (known on the host)."""
    starts = offsets[:-1][seq_index]
    lengths = offsets[1:][seq_index] - starts
    new_offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    return jagged.flat_index(starts, lengths, new_offsets, total)


def select(flat: FlatBatch, seq_ids: list[int]) -> tuple[FlatBatch, torch.Tensor]:
    """The sub-batch of sequences ``seq_ids`` and the flat index of its tokens in ``flat``."""
    device = flat.offsets.device
    seq_index = torch.tensor(seq_ids, dtype=torch.long, device=device)
    sub_lengths = [flat.seq_lens[i] for i in seq_ids]
    total = sum(sub_lengths)
    tok = token_index(flat.offsets, seq_index, total)
    offsets = torch.tensor([0] + sub_lengths, dtype=flat.offsets.dtype).cumsum(0).to(device, non_blocking=True)
    temperature = flat.temperature[seq_index] if torch.is_tensor(flat.temperature) else flat.temperature
    sub = FlatBatch(
        input_ids=flat.input_ids[tok],
        offsets=offsets,
        seq_lens=sub_lengths,
        fields={k: v[tok] for k, v in flat.fields.items()},
        seq_fields={k: v[seq_index] for k, v in flat.seq_fields.items()},
        temperature=temperature,
        # The host mask is indexed on the host, from the host lengths (no device read).
        scored=None if flat.scored is None else flat.scored[
            token_index(jagged.offsets_from_lengths(torch.tensor(flat.seq_lens, dtype=torch.long)),
                        torch.tensor(seq_ids, dtype=torch.long), total)],
        images=None if flat.images is None else flat.images.select(seq_ids),
    )
    return sub, tok


def placeholder(flat: FlatBatch) -> FlatBatch:
    """A one-token batch a rank runs, and discards, when it has fewer micro-batches than its peers."""
    ids = flat.input_ids.new_zeros(1)
    offsets = torch.tensor([0, 1], dtype=flat.offsets.dtype, device=flat.offsets.device)
    # Per-token fields get one harmless value (1) so the forward sees shapes that match its token.
    fields = {k: v.new_ones((1, *v.shape[1:])) for k, v in flat.fields.items()}
    # No image: a vision-language model still runs its tower on a dummy (engines/model/vision.py).
    images = None if flat.images is None else flat.images.without_images(1)
    return FlatBatch(ids, offsets, [1], fields=fields, images=images)


def is_placeholder(index: torch.Tensor | None) -> bool:
    """Whether a micro-batch's token index marks a :func:`placeholder` (nothing to merge back)."""
    return index is not None and index.numel() == 0


def split(flat: FlatBatch, max_tokens: int | None, num_groups: int | None = None
          ) -> list[tuple[FlatBatch, torch.Tensor | None]]:
    """Micro-batches of ``flat`` with their token index (None when the batch is not split).

    With ``num_groups`` there are exactly that many; an empty one is a :func:`placeholder`
    whose index is an empty tensor (nothing of it is merged back)."""
    if num_groups is None and (max_tokens is None or flat.total <= max_tokens):
        return [(flat, None)]
    if num_groups == 1 and flat.total > 0:
        return [(flat, None)]
    parts = []
    for group in plan_micro_batches(flat.seq_lens, max_tokens, num_groups):
        if sum(flat.seq_lens[i] for i in group) == 0:
            parts.append((placeholder(flat), flat.offsets.new_zeros(0)))
        else:
            parts.append(select(flat, group))
    return parts


def count_micro_batches(flat: FlatBatch, max_tokens: int | None) -> int:
    """How many micro-batches :func:`split` makes of ``flat`` without ``num_groups``."""
    if max_tokens is None or flat.total <= max_tokens:
        return 1
    return len(plan_micro_batches(flat.seq_lens, max_tokens))


def merge(parts: list[tuple[torch.Tensor, torch.Tensor | None]], total: int) -> torch.Tensor:
    """Scatter per-micro-batch flat results back into the full batch's token order."""
    if len(parts) == 1 and parts[0][1] is None:
        return parts[0][0]
    first = parts[0][0]
    out = first.new_zeros((total, *first.shape[1:]))
    for values, index in parts:
        if index.numel():
            out[index] = values
    return out
