"""Plain-torch reference implementations of four torch_npu fused ops, written from Ascend's documentation.

Strict on purpose: each raises where the real op's documented constraints are violated
(rotary_mul needs 4-D tensors and cos/sin in [-1, 1]; swiglu needs a contiguous input whose
split dim is even; fusion_attention checks layouts, head counts, mask shapes and that
``actual_seq_qlen``/``actual_seq_kvlen`` are cumulative and end at T). Return values follow
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

FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOKENS = 2147483647
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_TYPES:
        raise TypeError(f"{name}: dtype must be float16, bfloat16 or float32, got {t.dtype}")


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """y = x / sqrt(mean(x^2 over gamma's dims) + eps) * gamma, computed in fp32; returns (y, rstd)."""
    _check_float("self", x)
    if gamma.dtype != x.dtype:
        raise TypeError(f"gamma dtype must equal self's ({x.dtype}), got {gamma.dtype}")
    if not 1 <= x.dim() <= 8:
        raise ValueError(f"self must have 1-8 dims, got {x.dim()}")
    if gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of self {tuple(x.shape)}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """out = r1 * x + r2 * rotate(x); 'half' rotates halves (cat(-x2, x1)), 'interleave' pairs."""
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        if t.dim() != 4:
            raise ValueError(f"npu_rotary_mul: {name} must be a 4-D tensor, got {t.dim()}-D {tuple(t.shape)}")
        _check_float(name, t)
    if r1.dtype != x.dtype or r2.dtype != x.dtype:
        raise TypeError(f"npu_rotary_mul: r1/r2 dtype must equal input's ({x.dtype}), got {r1.dtype}/{r2.dtype}")
    if r1.shape != r2.shape:
        raise ValueError(f"npu_rotary_mul: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must match")
    if r1.shape[-1] != x.shape[-1] or any(r not in (1, s) for r, s in zip(r1.shape, x.shape)):
        raise ValueError(f"npu_rotary_mul: r1 {tuple(r1.shape)} does not broadcast to input {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"npu_rotary_mul: D must be even, got {x.shape[-1]}")
    if rotary_mode not in ("half", "interleave"):
        raise ValueError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if torch.is_grad_enabled() and (r1.requires_grad or r2.requires_grad):
        # Documented (half mode): when cos/sin need gradients, B*N <= 1024, B*N being the axes
        # r1/r2 broadcast over (11SD for BNSD, 1S1D for BSND, S11D for SBND).
        broadcast = 1
        for r, s in zip(r1.shape, x.shape):
            broadcast *= s if r == 1 else 1
        if broadcast > 1024:
            raise ValueError(f"npu_rotary_mul: with gradients for r1/r2, B*N (the broadcast axes) must be "
                             f"<= 1024, got {broadcast}")
    for name, t in (("r1", r1), ("r2", r2)):
        if t.numel() and t.abs().max().item() > 1.0 + 1e-6:
            raise ValueError(f"npu_rotary_mul: {name} values must lie in [-1, 1]")
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return r1 * x + r2 * rotated


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """out = silu(A) * B where A, B are the first and second halves of x along dim."""
    _check_float("input", x)
    if not x.is_contiguous():
        raise ValueError("npu_swiglu: input must be contiguous")
    if x.numel() == 0:
        raise ValueError("npu_swiglu: empty input is not supported")
    if not 1 <= x.dim() <= 8:
        raise ValueError(f"npu_swiglu: input must have 1-8 dims, got {x.dim()}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"npu_swiglu: dim must be in [{-x.dim()}, {x.dim() - 1}], got {dim}")
    if x.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: size {x.shape[dim]} of dim {dim} must be even")
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


def _check_compressed_causal(atten_mask: torch.Tensor | None, sparse_mode: int) -> None:
    if atten_mask is None:
        raise ValueError(f"sparse_mode {sparse_mode} needs the compressed 2048x2048 causal atten_mask")
    if tuple(atten_mask.shape) != (2048, 2048):
        raise ValueError(f"sparse_mode {sparse_mode} needs atten_mask of shape (2048, 2048), got {tuple(atten_mask.shape)}")
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


def _check_cumulative(name: str, ends, total: int) -> list[int]:
    if ends is None:
        raise ValueError(f"input_layout TND needs {name}")
    if isinstance(ends, torch.Tensor) or not isinstance(ends, (list, tuple)):
        raise TypeError(f"{name} must be a host list of ints, got {type(ends).__name__}")
    ends = [int(e) for e in ends]
    if not ends or ends[0] < 0 or any(b < a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"{name} must be cumulative (non-decreasing) lengths, got {ends}")
    if ends[-1] != total:
        raise ValueError(f"{name} must end at T={total}, got {ends}")
    return ends


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    """softmax(scale * q k^T, masked where atten_mask is True) v, in the given layout (GQA allowed)."""
    if input_layout not in LAYOUTS:
        raise ValueError(f"input_layout must be one of {LAYOUTS}, got {input_layout!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_float(name, t)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query/key/value dtypes must match, got {query.dtype}/{key.dtype}/{value.dtype}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if padding_mask is not None:
        raise ValueError("padding_mask is not supported (documented as not yet supported)")
    if pse is not None or prefix is not None:
        raise NotImplementedError("the reference implements neither pse nor prefix")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")
    if sparse_mode not in (0, 1, 2, 3):
        raise NotImplementedError(f"the reference implements sparse_mode 0-3, got {sparse_mode}")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"atten_mask must be bool or uint8, got {atten_mask.dtype}")
    if sparse_mode in (2, 3):
        _check_compressed_causal(atten_mask, sparse_mode)
    elif sparse_mode == 1 and atten_mask is None:
        raise ValueError("sparse_mode 1 needs the full atten_mask")
    expected_dims = 3 if input_layout in ("BSH", "SBH", "TND") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != expected_dims:
            raise ValueError(f"{input_layout}: {name} must be {expected_dims}-D, got {tuple(t.shape)}")

    if input_layout == "TND":
        t_q, n_q, d = query.shape
        t_kv, n_kv, _ = key.shape
        if key.shape[2] != d:
            raise ValueError(f"head dims differ: query {d}, key {key.shape[2]}")
        if head_num != n_q or n_q % n_kv:
            raise ValueError(f"head_num {head_num} must equal query heads {n_q}, a multiple of key heads {n_kv}")
        q_ends = _check_cumulative("actual_seq_qlen", actual_seq_qlen, t_q)
        kv_ends = _check_cumulative("actual_seq_kvlen", actual_seq_kvlen, t_kv)
        if len(q_ends) != len(kv_ends):
            raise ValueError(f"actual_seq_qlen ({len(q_ends)}) and actual_seq_kvlen ({len(kv_ends)}) lengths differ")
        if atten_mask is not None and sparse_mode in (0, 1) and atten_mask.dim() != 2:
            raise ValueError(f"TND takes only an SS atten_mask, got {tuple(atten_mask.shape)}")
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
        if query.shape[-1] % head_num:
            raise ValueError(f"H={query.shape[-1]} is not divisible by head_num {head_num}")
        kv_heads = key.shape[-1] // (query.shape[-1] // head_num)
    else:
        kv_heads = key.shape[2] if input_layout == "BSND" else key.shape[1]
    q = _to_bnsd(query, input_layout, head_num)
    k = _to_bnsd(key, input_layout, kv_heads)
    v = _to_bnsd(value, input_layout, kv_heads)
    b, n_q, sq, d = q.shape
    _, n_kv, skv, _ = k.shape
    if head_num != n_q or n_q % n_kv:
        raise ValueError(f"head_num {head_num} must equal query heads {n_q}, a multiple of key heads {n_kv}")
    if k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)} in {input_layout}")
    masked = None
    if atten_mask is not None:
        if sparse_mode in (0, 1):
            allowed = [(b, n_q, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)]
            if tuple(atten_mask.shape) not in allowed:
                raise ValueError(f"atten_mask shape must be one of BNSS/B1SS/11SS/SS {allowed}, got {tuple(atten_mask.shape)}")
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
