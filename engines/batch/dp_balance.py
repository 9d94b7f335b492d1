"""Token-balanced data-parallel batches (``EngineConfig.balance_dp_tokens``).

Each data-parallel replica (a rank, or a sequence-parallel group whose ranks hold the same
batch) brings its own batch. With balancing on, the replicas' sequences are pooled and
re-assigned so every replica gets about the same number of tokens (longest first onto the
lightest replica: micro_batch.plan_micro_batches), the forward runs on the new assignment,
and per-token outputs travel back to the replica that brought each sequence, in the caller's
order (the bug class of verl #2185: reordered outputs misaligned with rewards).

A sequence with images also weighs its vision tower's work: ``tokens + patch_cost x patches``
(engines/model/vision.py: patch_cost; Qwen2-VL-7B 0.098 decoder tokens a patch, so an image token
weighs 1.39), and the imbalance metrics count those weights. Text-only sequences weigh their
tokens, exactly as before.

Losses are normalised by the step's global counts, so moving sequences between replicas does
not change the loss or the summed gradients; it changes which rank waits for which.
Sequences travel through ``all_gather_object`` on the host: simple, one host round trip per
batch, and every rank briefly holds the whole step's batch (fine for token ids; large
per-token fields make it costly).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from polyfsdp.backends.distributed import all_gather_object
from polyfsdp.backends.topology import Topology

from .flat import FlatBatch
from .images import ImageInputs
from .micro import plan_micro_batches


def token_imbalance(loads: list[int]) -> float:
    """``max / mean`` of the replicas' token counts (1.0 is perfect balance, and for no tokens)."""
    total = sum(loads)
    return 1.0 if total == 0 else max(loads) * len(loads) / total


def sequence_weights(lengths: list[list[int]], patches: list[list[int]] | None = None,
                     patch_cost: float = 0.0) -> list[list[float]]:
    """Each replica's sequences' weights: tokens plus ``patch_cost`` per image patch; the token
    counts themselves (ints) when no sequence holds an image or patches cost nothing."""
    if not patch_cost or patches is None or not any(any(ps) for ps in patches):
        return lengths
    return [[n + patch_cost * p for n, p in zip(lens, ps)] for lens, ps in zip(lengths, patches)]


def balance_plan(lengths: list[list[int]], patches: list[list[int]] | None = None,
                 patch_cost: float = 0.0) -> list[list[tuple[int, int]]]:
    """For each replica, the ``(source replica, sequence index)`` pairs it runs, balanced by
    :func:`sequence_weights` (tokens, and image patches at ``patch_cost`` tokens each)."""
    weights = sequence_weights(lengths, patches, patch_cost)
    items = [(replica, i) for replica, lens in enumerate(weights) for i in range(len(lens))]
    flat_lengths = [weights[r][i] for r, i in items]
    groups = plan_micro_batches(flat_lengths, None, num_groups=len(lengths))
    return [[items[j] for j in group] for group in groups]


def _host(flat: FlatBatch) -> FlatBatch:
    return flat.to(torch.device("cpu"))


def _sequence(flat: FlatBatch, i: int) -> dict:
    start, end = sum(flat.seq_lens[:i]), sum(flat.seq_lens[:i + 1])
    temperature = flat.temperature[i] if torch.is_tensor(flat.temperature) else torch.tensor(flat.temperature)
    return {"input_ids": flat.input_ids[start:end], "fields": {k: v[start:end] for k, v in flat.fields.items()},
            "seq_fields": {k: v[i] for k, v in flat.seq_fields.items()}, "temperature": temperature,
            "scored": None if flat.scored is None else flat.scored[start:end],
            "images": None if flat.images is None else flat.images.select([i])}


def _assemble(sequences: list[dict], like: FlatBatch, device) -> FlatBatch:
    lengths = [s["input_ids"].shape[0] for s in sequences]
    offsets = torch.tensor([0, *lengths]).cumsum(0)

    def cat(parts, empty):
        return torch.cat(parts) if parts else empty

    fields = {k: cat([s["fields"][k] for s in sequences], v[:0].cpu()) for k, v in like.fields.items()}
    seq_fields = {k: torch.stack([s["seq_fields"][k] for s in sequences]) if sequences else v[:0].cpu()
                  for k, v in like.seq_fields.items()}
    # One value per sequence: replicas may have called with different temperatures.
    temperature = torch.stack([s["temperature"].float() for s in sequences]) if sequences else like.temperature
    # Scored positions travel only when every sequence brought them (else the whole head runs).
    scored = None if any(s["scored"] is None for s in sequences) else cat([s["scored"] for s in sequences],
                                                                          torch.zeros(0, dtype=torch.bool))
    # A sequence's images travel with it (engines/batch/images.py); a replica's batch without
    # images (text-only callers) contributes none.
    images = None if like.images is None else ImageInputs.cat(
        [s["images"] for s in sequences if s["images"] is not None] or [like.images.without_images(0)])
    if images is not None and len(images.images_per_seq) != len(sequences):
        raise ValueError("balance_dp_tokens: some replicas' batches carry images and some do not; pass "
                         "pixel_values and image_grid_thw on every rank (empty for text-only sequences)")
    flat = FlatBatch(cat([s["input_ids"] for s in sequences], like.input_ids[:0].cpu()), offsets, lengths,
                     fields, seq_fields, temperature, scored, images)
    return flat.to(device)  # tensors already on ``device`` are kept, not copied


@dataclass
class Balanced:
    """This replica's balanced batch, where its sequences came from, and the imbalance before/after."""

    flat: FlatBatch
    origin: list[tuple[int, int]]
    before: float
    after: float


def balance(flat: FlatBatch, topo: Topology, patch_cost: float = 0.0) -> Balanced:
    """Re-assign the step's sequences over the data-parallel replicas of ``topo`` by tokens, and
    image patches at ``patch_cost`` tokens each (the ranks of one replica's SP group hold one batch)."""
    replica = topo.replica
    batches = topo.one_per_replica(all_gather_object(_host(flat)))
    patches = [None if b.images is None else b.images.patches_per_seq() for b in batches]
    patches = None if all(p is None for p in patches) else [p or [0] * b.num_seqs for p, b in zip(patches, batches)]
    weights = sequence_weights([b.seq_lens for b in batches], patches, patch_cost)
    plan = balance_plan([b.seq_lens for b in batches], patches, patch_cost)
    mine = [_sequence(batches[r], i) for r, i in plan[replica]]
    after = [sum(weights[r][i] for r, i in group) for group in plan]
    return Balanced(_assemble(mine, flat, flat.input_ids.device), plan[replica],
                    token_imbalance([sum(w) for w in weights]), token_imbalance(after))


def restore(values: torch.Tensor, balanced: Balanced, original: FlatBatch, topo: Topology) -> torch.Tensor:
    """Per-token ``values (total,)`` of the balanced batch -> flat values of ``original`` (this
    replica's own sequences, in the caller's order)."""
    bounds = [0]
    for n in balanced.flat.seq_lens:
        bounds.append(bounds[-1] + n)
    host = values.detach().cpu()
    pieces = {origin: host[s:e] for origin, s, e in zip(balanced.origin, bounds[:-1], bounds[1:])}
    everyone = topo.one_per_replica(all_gather_object(pieces))
    replica = topo.replica
    found = {}
    for held in everyone:
        found.update({i: v for (r, i), v in held.items() if r == replica})
    parts = [found[i] for i in range(original.num_seqs)]
    out = torch.cat(parts) if parts else host[:0]
    return out.to(values.device)

