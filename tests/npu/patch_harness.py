"""Shared by the CPU and device patch tests: tiny gated-decoder models, batches, an independent reference.

The reference for patched logits is the UNPATCHED model run on each sequence alone (no
padding, no packing), so padded and packed checks both compare against the same thing.
"""
from __future__ import annotations

import torch
# Imported up front: transformers probes for torch_npu once, on first import, and caches the
# answer; that must not happen while a test has the stand-in module installed.
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 64
LENGTHS = (7, 4, 2)


def _family_classes(family: str):
    return {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
    }[family]


FAMILIES = ("qwen2", "qwen3", "llama")


def tiny_config(family: str, hidden_size: int = 32, heads: int = 4, kv_heads: int = 2, **overrides):
    """A 2-layer config with grouped-query attention (4 query heads, 2 key/value heads)."""
    config_cls, _, extra = _family_classes(family)
    kwargs = dict(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                  attn_implementation="sdpa", pad_token_id=0, **extra)
    if "head_dim" in extra:
        kwargs["head_dim"] = hidden_size // heads
    kwargs.update(overrides)
    return config_cls(**kwargs)


def tiny_model(family: str, seed: int = 0, config=None, **overrides):
    """A seeded tiny causal LM of the family, in eval mode, fp32, on CPU."""
    _, model_cls, _ = _family_classes(family)
    torch.manual_seed(seed)
    return model_cls(config if config is not None else tiny_config(family, **overrides)).eval()


def sequences(lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    """Random token sequences (never the pad id 0) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]


def right_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) input ids and attention mask, right-padded with 0."""
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def packed(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1, T) input ids, position ids restarting per sequence, and int32 cumulative lengths."""
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    cu = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return ids, positions, cu


@torch.no_grad()
def per_sequence_logits(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of each sequence run alone, shape (len, vocab) each."""
    device = next(model.parameters()).device
    return [model(input_ids=s[None].to(device), use_cache=False).logits[0].float().cpu() for s in seqs]


@torch.no_grad()
def padded_logits(model, seqs) -> list[torch.Tensor]:
    """Per-sequence logits from one right-padded (B, L) call, padding dropped."""
    device = next(model.parameters()).device
    ids, mask = right_padded(seqs)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits.float().cpu()
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


@torch.no_grad()
def packed_logits(model, seqs, with_cu_seqlens: bool = False) -> list[torch.Tensor]:
    """Per-sequence logits from one packed (1, T) call with restarting position ids."""
    device = next(model.parameters()).device
    ids, positions, cu = packed(seqs)
    extra = {}
    if with_cu_seqlens:
        longest = max(len(s) for s in seqs)
        extra = dict(cu_seq_lens_q=cu.to(device), cu_seq_lens_k=cu.to(device), max_length_q=longest,
                     max_length_k=longest)
    logits = model(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False, **extra)
    return list(logits.logits[0].float().cpu().split([len(s) for s in seqs]))


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest absolute difference over matching per-sequence tensors."""
    return max((g - w).abs().max().item() for g, w in zip(got, want))
