"""Plain-torch reference implementations of four torch_npu fused ops, written from Ascend's documentation.

Strict on purpose: each raises where the real op's documented constraints are violated, by
calling the checks of ``polyfsdp.backends.npu_limits`` (the one table of those limits, each
with its Ascend page; the NPU backend reads the same table before a patch applies). What is
left here is the arithmetic, plus refusals of what the reference does not implement. Return values follow
the documented signatures: ``npu_rms_norm -> (y, rstd)``, ``npu_rotary_mul -> Tensor``,
``npu_swiglu -> Tensor``, ``npu_fusion_attention -> (out, softmax_max, softmax_sum,
softmax_out, seed, offset, numels)``.

``reference_torch_npu()`` builds a stand-in ``torch_npu`` module; ``installed_reference_torch_npu()``
puts it in ``sys.modules`` for the duration of a block so ``NPUBackend().fused_ops()`` finds it.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import torch
import torch.nn.functional as F

from polyfsdp.backends import npu_limits as limits

MAX_TOKENS = 2147483647


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """y = x / sqrt(mean(x^2 over gamma's dims) + eps) * gamma, computed in fp32; returns (y, rstd)."""
    limits.check_rms_norm_call(x, gamma)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """out = r1 * x + r2 * rotate(x); 'half' rotates halves (cat(-x2, x1))."""
    limits.check_rotary_mul_call(x, r1, r2, rotary_mode)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return r1 * x + r2 * rotated


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """out = silu(A) * B where A, B are the first and second halves of x along dim."""
    limits.check_swiglu_call(x, dim)
    a, b = torch.chunk(x, 2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(x.dtype)


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).transpose(1, 2)
    s, b, h = t.shape  # SBH
    return t.view(s, b, heads, h // heads).permute(1, 2, 0, 3)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


_COMPRESSED_CAUSAL: dict = {}


def _compressed_causal(device) -> torch.Tensor:
    if device not in _COMPRESSED_CAUSAL:
        _COMPRESSED_CAUSAL[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return _COMPRESSED_CAUSAL[device]


def _check_compressed_causal(atten_mask: torch.Tensor, sparse_mode: int) -> None:
    # The shape is a documented limit (checked by npu_limits); the content is what the op assumes.
    if not torch.equal(atten_mask.bool(), _compressed_causal(atten_mask.device)):
        raise ValueError(f"sparse_mode {sparse_mode} needs atten_mask = triu(ones(2048, 2048), diagonal=1)")


def _masked_positions(sq: int, skv: int, atten_mask, sparse_mode: int, pre: int, nxt: int, device) -> torch.Tensor:
    """Boolean (..., sq, skv) positions to drop for one attention block; True = masked."""
    rows = torch.arange(sq, device=device)[:, None]
    cols = torch.arange(skv, device=device)[None, :]
    if sparse_mode == 2:  # causal from the top-left corner
        return cols > rows
    if sparse_mode == 3:  # causal from the bottom-right corner
        return cols > rows + (skv - sq)
    masked = atten_mask.bool()
    if sparse_mode == 0:  # the band given by pre/next tokens, on top of the explicit mask
        masked = masked | (cols > rows + nxt) | (cols < rows - pre)
    return masked


def _attend(q, k, v, masked, scale, keep_prob):
    """q (B, N, Sq, D), k/v (B, Nkv, Skv, D); masked broadcastable to (B, N, Sq, Skv)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if masked is not None:
        masked = torch.broadcast_to(masked, scores.shape)
        if masked.all(dim=-1).any():
            raise ValueError("atten_mask masks every key of some query row (undefined softmax)")
        scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_sum = torch.exp(scores - row_max).sum(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    if keep_prob < 1.0:
        probs = F.dropout(probs, p=1.0 - keep_prob)
    out = torch.matmul(probs, v.float()).to(q.dtype)
    return out, row_max, row_sum


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    """softmax(scale * q k^T, masked where atten_mask is True) v, in the given layout (GQA allowed)."""
    ends = limits.check_fusion_attention_call(query, key, value, head_num, input_layout, padding_mask, atten_mask,
                                              keep_prob, actual_seq_qlen, actual_seq_kvlen, sparse_mode)
    if pse is not None or prefix is not None:
        raise NotImplementedError("the reference implements neither pse nor prefix")
    if sparse_mode not in (0, 1, 2, 3):
        raise NotImplementedError(f"the reference implements sparse_mode 0-3, got {sparse_mode}")
    if sparse_mode in (2, 3):
        _check_compressed_causal(atten_mask, sparse_mode)
    elif sparse_mode == 1 and atten_mask is None:
        raise ValueError("sparse_mode 1 needs the full atten_mask")

    if input_layout == "TND":
        t_q, n_q, _ = query.shape
        q_ends, kv_ends = ends
        out = torch.empty_like(query)
        row_max = torch.zeros(t_q, n_q, 1, dtype=torch.float32, device=query.device)
        row_sum = torch.zeros_like(row_max)
        q_start = kv_start = 0
        for q_end, kv_end in zip(q_ends, kv_ends):
            sq, skv = q_end - q_start, kv_end - kv_start
            if sq:
                q = query[q_start:q_end].transpose(0, 1)[None]
                k = key[kv_start:kv_end].transpose(0, 1)[None]
                v = value[kv_start:kv_end].transpose(0, 1)[None]
                masked = None
                if atten_mask is not None:
                    block = atten_mask[:sq, :skv] if sparse_mode in (0, 1) else None
                    masked = _masked_positions(sq, skv, block, sparse_mode, pre_tockens, next_tockens, query.device)
                o, m, s = _attend(q, k, v, masked, scale, keep_prob)
                out[q_start:q_end] = o[0].transpose(0, 1)
                row_max[q_start:q_end] = m[0].transpose(0, 1)
                row_sum[q_start:q_end] = s[0].transpose(0, 1)
            q_start, kv_start = q_end, kv_end
        return out, row_max.expand(-1, -1, 8), row_sum.expand(-1, -1, 8), torch.empty(0), 0, 0, 0

    if input_layout in ("BSH", "SBH"):
        kv_heads = key.shape[-1] // (query.shape[-1] // head_num)
    else:
        kv_heads = key.shape[2] if input_layout == "BSND" else key.shape[1]
    q = _to_bnsd(query, input_layout, head_num)
    k = _to_bnsd(key, input_layout, kv_heads)
    v = _to_bnsd(value, input_layout, kv_heads)
    sq, skv = q.shape[2], k.shape[2]
    masked = None
    if atten_mask is not None:
        masked = _masked_positions(sq, skv, atten_mask, sparse_mode, pre_tockens, next_tockens, query.device)
    out, row_max, row_sum = _attend(q, k, v, masked, scale, keep_prob)
    return _from_bnsd(out, input_layout), row_max.expand(-1, -1, -1, 8), row_sum.expand(-1, -1, -1, 8), torch.empty(0), 0, 0, 0


def reference_torch_npu() -> types.ModuleType:
    """A stand-in ``torch_npu`` module exposing the four reference ops (version matches torch)."""
    module = types.ModuleType("torch_npu")
    # A spec keeps importlib.util.find_spec("torch_npu") (used by transformers' probes) from raising.
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.__version__ = torch.__version__
    module.npu_rms_norm = npu_rms_norm
    module.npu_rotary_mul = npu_rotary_mul
    module.npu_swiglu = npu_swiglu
    module.npu_fusion_attention = npu_fusion_attention
    return module


@contextlib.contextmanager
def installed_reference_torch_npu():
    """Put the stand-in in ``sys.modules['torch_npu']`` for the block; restore what was there after."""
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = reference_torch_npu()
    try:
        yield sys.modules["torch_npu"]
    finally:
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous
