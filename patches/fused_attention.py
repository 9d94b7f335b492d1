"""Attention through the backend's ``fusion_attention`` op, registered with transformers under one name.

Selected per model: the attention patch gives the model a private config whose
``_attn_implementation`` is :data:`ATTN_NAME`, and puts the op on each attention module.
Packed batches (batch 1, position ids restarting per sequence, or ``cu_seq_lens_q`` kwargs)
run in TND layout with cumulative ``actual_seq_qlen``; padded batches run in BSND with a
boolean mask (True = masked) that combines causal and padding.
"""
from __future__ import annotations

import torch

from polyfsdp.backends.base import HOST_CU_SEQ_LENS

ATTN_NAME = "polyfsdp_fusion_attention"
OP_ATTR = "_polyfsdp_fusion_attention_op"
# sparse_mode 3 (causal, aligned bottom-right) takes this fixed, compressed 2048 x 2048 mask.
_CAUSAL_SPARSE_MODE = 3
_EXPLICIT_MASK_SPARSE_MODE = 0
_COMPRESSED = 2048
_compressed_masks: dict[torch.device, torch.Tensor] = {}
_registered = False


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048 x 2048 upper-triangular boolean mask the causal sparse mode expects (one per device)."""
    if device not in _compressed_masks:
        ones = torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device)
        _compressed_masks[device] = torch.triu(ones, diagonal=1)
    return _compressed_masks[device]


def padding_mask_for_fusion(attention_mask: torch.Tensor, q_length: int) -> torch.Tensor:
    """(B, Skv) keep-mask -> (B, 1, Sq, Skv) boolean mask, True = masked, causal aligned bottom-right.

    A padding query with no visible key may see its own slot: the output there is ignored,
    and a fully masked row would make the softmax undefined.
    """
    batch, kv_length = attention_mask.shape
    offset = kv_length - q_length
    rows = torch.arange(q_length, device=attention_mask.device)[:, None] + offset
    cols = torch.arange(kv_length, device=attention_mask.device)[None, :]
    masked = (cols > rows)[None] | ~attention_mask.bool()[:, None, :]
    empty_rows = masked.all(dim=-1, keepdim=True)
    masked = masked & ~((cols == rows)[None] & empty_rows)
    return masked[:, None]


def _cumulative(lengths: torch.Tensor | list[int], total: int, what: str) -> list[int]:
    values = lengths if isinstance(lengths, (list, tuple)) else lengths.reshape(-1).tolist()
    cumulative = [int(v) for v in values]
    if not cumulative or cumulative[0] != 0 or cumulative[-1] != total or any(
        b < a for a, b in zip(cumulative, cumulative[1:])
    ):
        raise ValueError(f"{what} must rise from 0 to the token count {total}, got {cumulative}")
    return cumulative[1:]


def packed_lengths(kwargs: dict, batch: int, q_length: int, kv_length: int) -> tuple[list[int], list[int]] | None:
    """Cumulative (q, kv) sequence ends for a packed (1, T) batch, or None when not packed."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q needs a packed batch of 1 row, got batch {batch}")
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is None or cu_k is cu_q:
            # One set of boundaries for queries and keys: read it once, from the engine's host
            # copy when there is one.
            host = kwargs.get(HOST_CU_SEQ_LENS)
            bounds = list(host) if host is not None else cu_q.reshape(-1).tolist()
            return _cumulative(bounds, q_length, "cu_seq_lens_q"), _cumulative(bounds, kv_length, "cu_seq_lens_k")
        q_ends = _cumulative(cu_q, q_length, "cu_seq_lens_q")
        kv_ends = _cumulative(cu_k if cu_k is not None else cu_q, kv_length, "cu_seq_lens_k")
        return q_ends, kv_ends
    position_ids = kwargs.get("position_ids")
    if position_ids is None or batch != 1 or q_length != kv_length or q_length < 2:
        return None
    positions = position_ids.reshape(-1)
    if positions.numel() != q_length:
        return None
    # The op takes host-side lengths, so one host sync here is unavoidable.
    starts = (torch.nonzero(positions[1:] - positions[:-1] != 1).reshape(-1) + 1).tolist()
    if not starts:
        return None
    ends = [int(s) for s in starts] + [q_length]
    return ends, ends


def fusion_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q/k/v are (B, N, S, D); returns ((B, S, N, D), None)."""
    op = getattr(module, OP_ATTR, None)
    if op is None:
        raise RuntimeError(
            f"{type(module).__name__} selects {ATTN_NAME!r} but carries no fused op; "
            "apply it with polyfsdp.patches.apply_patches"
        )
    if sliding_window is not None:
        raise NotImplementedError(f"{ATTN_NAME} does not implement sliding-window attention")
    batch, heads, q_length, head_dim = query.shape
    kv_length = key.shape[2]
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    keep_prob = 1.0 - float(dropout)
    causal = compressed_causal_mask(query.device)
    packed = packed_lengths(kwargs, batch, q_length, kv_length) if attention_mask is None else None
    if packed is not None:
        q_ends, kv_ends = packed
        out = op(
            query[0].transpose(0, 1).contiguous(),
            key[0].transpose(0, 1).contiguous(),
            value[0].transpose(0, 1).contiguous(),
            heads,
            "TND",
            atten_mask=causal,
            scale=scale,
            keep_prob=keep_prob,
            actual_seq_qlen=q_ends,
            actual_seq_kvlen=kv_ends,
            sparse_mode=_CAUSAL_SPARSE_MODE,
        )[0]
        return out.unsqueeze(0), None
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    if attention_mask is None:
        mask, sparse_mode = causal, _CAUSAL_SPARSE_MODE
    elif attention_mask.dim() == 2:
        mask, sparse_mode = padding_mask_for_fusion(attention_mask, q_length), _EXPLICIT_MASK_SPARSE_MODE
    elif attention_mask.dim() == 4 and attention_mask.dtype == torch.bool:
        # A prepared 4-D boolean mask follows transformers' convention (True = attend).
        mask, sparse_mode = ~attention_mask, _EXPLICIT_MASK_SPARSE_MODE
    else:
        raise TypeError(
            f"{ATTN_NAME} expects a 2-D padding mask or a 4-D boolean mask, got "
            f"{attention_mask.dim()}-D {attention_mask.dtype}"
        )
    out = op(q, k, v, heads, "BSND", atten_mask=mask, scale=scale, keep_prob=keep_prob, sparse_mode=sparse_mode)[0]
    return out, None


def fusion_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask hook for transformers' masking utils: pass the 2-D padding mask through (None if no padding);
    causality and packing are handled inside :func:`fusion_attention_forward`."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register_with_transformers() -> None:
    """Register :data:`ATTN_NAME` with transformers' attention and mask interfaces (once, by name only)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, fusion_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, fusion_attention_mask)
    _registered = True
