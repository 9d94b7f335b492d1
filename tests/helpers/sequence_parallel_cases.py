"""Cases of the sequence-parallel tests (tests/distributed/test_sequence_parallel.py)."""
import torch

# Packed totals 16 (even: one sequence ends exactly on the sp=2 shard boundary) and 15 (odd:
# padded, a sequence crosses the boundary); lengths 1 (shorter than sp) and 2 (= sp).
INFER_LENGTHS = [3, 1, 4, 7, 1]
TRAIN_LENGTHS = [2, 5, 6, 1, 1]

# (name, use_remove_padding, use_fused_kernels, pad_mode, other EngineConfig keys)
MODES = tuple(
    (f"{'rmpad' if rmpad else 'padded'}_{'fused' if fused else 'unfused'}_{pad_mode}", rmpad, fused, pad_mode, {})
    for rmpad in (True, False) for fused in (True, False) for pad_mode in ("no_padding", "left_right")
) + (
    # Recomputation in backward repeats the all-to-alls; a token budget splits the batch.
    ("rmpad_fused_checkpointed_budget", True, True, "no_padding", {"gradient_checkpointing": True,
                                                                   "max_tokens_per_micro_batch": 8}),
)


def temperatures(num_seqs):
    """Per-sequence temperatures (each token's temperature must follow it across shards)."""
    return torch.linspace(0.6, 1.4, num_seqs)


# A critic's modes under SP (its value head runs on each rank's shard): (name, use_remove_padding, pad_mode).
CRITIC_MODES = (("critic_rmpad_no_padding", True, "no_padding"), ("critic_padded_left_right", False, "left_right"))
CRITIC_CLIP = 0.3


def critic_fields(seqs):
    """Seeded ``old_values`` and ``returns`` for the clipped value loss (the same on every rank)."""
    g = torch.Generator().manual_seed(4)
    old = [torch.randn(len(s), generator=g) * 0.5 for s in seqs]
    return old, [torch.randn(len(s), generator=g) for s in seqs]
