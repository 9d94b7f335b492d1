"""The documented limits of the four torch_npu ops polyfsdp patches in, in ONE table.

Two readers share it:
- ``model_problem(op, facts)``: before a patch applies, the limits a model's config decides
  (dtype, head dimension, head counts); a model outside them keeps the plain op and the patch
  report names the failed limit (``NPUBackend.fused_op_unsupported``).
- ``check_*_call``: every limit of one op call, raised as an error; the plain-torch reference ops
  (tests/npu/reference_ops.py) call these, so CPU tests catch a patch that would call an op
  outside its limits.

Each limit cites the Ascend page it comes from (``SOURCES``). Facts only; the wording is ours.
A few limits depend on the torch_npu release; every release that matches a torch polyfsdp
supports (>= 2.6) has them all, see docs/architecture.md "Ascend op limits".
"""
from __future__ import annotations

import torch

from .base import ModelFacts

# Op documentation pages (Ascend Extension for PyTorch / op-plugin).
SOURCES = {
    "npu_fusion_attention": "https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu_fusion_attention.md",
    "npu_rotary_mul": "https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu_rotary_mul.md",
    "npu_rms_norm": "https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000860.html",
    "npu_swiglu": "https://hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000834.html",
}
# polyfsdp op name (backend.fused_ops() key) -> torch_npu attribute.
OP_NAMES = {
    "rms_norm": "npu_rms_norm",
    "rotary_mul": "npu_rotary_mul",
    "swiglu": "npu_swiglu",
    "fusion_attention": "npu_fusion_attention",
}

# Every op: float16, bfloat16, float32 (fusion_attention: float32 since Ascend Extension for
# PyTorch 6.0.RC3; the CANN 7.0.0 page lists float16/bfloat16 only).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# npu_fusion_attention ("约束说明" of its page).
FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
FA_HEAD_DIM = (1, 768)            # D: Dq == Dk >= Dv, 1..768
FA_QUERY_HEADS = (1, 256)         # Nq 1..256; Nq / Nkv a positive integer (GQA)
FA_BATCH = (1, 2 * 1024 * 1024)   # B, non-varlen: 1..2M
FA_SEQ = (1, 1024 * 1024)         # S: 1..1M
FA_TOKENS = (1, 1024 * 1024)      # varlen T (= B*S): 1..1M
FA_VARLEN_SEQUENCES = 1024        # varlen: len(actual_seq_qlen) at most 1K
FA_MASK_DTYPES = (torch.bool, torch.uint8)
FA_COMPRESSED_MASK = (2048, 2048)  # sparse_mode 2/3/4/7/8: triu(ones(2048, 2048), 1)

# npu_rotary_mul, half mode, jit_compile=False (Atlas A2/A3 training).
ROPE_HEAD_DIM_BELOW = 896         # D < 896 and even
ROPE_BATCH_HEADS_BELOW = 1000     # B < 1000 and N < 1000
ROPE_GRAD_BROADCAST = 1024        # B*N <= 1024 when cos/sin need gradients
ROPE_VALUE_RANGE = 1.0            # r1, r2 within [-1, 1]

# npu_rms_norm: x 2..8 dims, gamma of x's dtype with x's trailing shape.
RMS_NORM_DIMS = (2, 8)
# npu_swiglu: 1..8 dims, contiguous, non-empty, the split dim even.
SWIGLU_DIMS = (1, 8)


class OpLimitError(ValueError):
    """An op call outside a documented limit; the message names the op, the limit and its page."""


def _fail(op: str, what: str) -> OpLimitError:
    return OpLimitError(f"{op}: {what} (documented limit: {SOURCES[op]})")


def _in(value: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= value <= bounds[1]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_dtype(op: str, name: str, dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise _fail(op, f"{name} dtype {_dtype_name(dtype)} is not float16, bfloat16 or float32")


# ----------------------------------------------------------------------------- per model
def _model_checks(op: str, facts: ModelFacts) -> None:
    _check_dtype(op, "compute", facts.compute_dtype)
    heads, kv_heads, head_dim = facts.num_attention_heads, facts.num_key_value_heads, facts.head_dim
    if op == "npu_fusion_attention":
        if not _in(head_dim, FA_HEAD_DIM):
            raise _fail(op, f"head_dim {head_dim} outside {FA_HEAD_DIM[0]}..{FA_HEAD_DIM[1]}")
        if not _in(heads, FA_QUERY_HEADS):
            raise _fail(op, f"num_attention_heads {heads} outside {FA_QUERY_HEADS[0]}..{FA_QUERY_HEADS[1]}")
        if kv_heads < 1 or heads % kv_heads:
            raise _fail(op, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    elif op == "npu_rotary_mul":
        if head_dim % 2 or head_dim >= ROPE_HEAD_DIM_BELOW:
            raise _fail(op, f"head_dim {head_dim} must be even and below {ROPE_HEAD_DIM_BELOW}")
        if max(heads, kv_heads) >= ROPE_BATCH_HEADS_BELOW:
            raise _fail(op, f"head count {max(heads, kv_heads)} must be below {ROPE_BATCH_HEADS_BELOW}")


def model_problem(op_name: str, facts: ModelFacts) -> str | None:
    """Why a model with these facts must not use the fused op ``op_name`` (``fusion_attention``,
    ``rotary_mul``, ``rms_norm``, ``swiglu``), or None when its config is inside every limit."""
    op = OP_NAMES.get(op_name)
    if op is None:
        return None
    try:
        _model_checks(op, facts)
    except OpLimitError as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------- per call
def check_rms_norm_call(x: torch.Tensor, gamma: torch.Tensor) -> None:
    """Raise :class:`OpLimitError` where ``npu_rms_norm(x, gamma)`` is outside its documented limits."""
    op = "npu_rms_norm"
    _check_dtype(op, "self", x.dtype)
    if gamma.dtype != x.dtype:
        raise _fail(op, f"gamma dtype {_dtype_name(gamma.dtype)} differs from self's {_dtype_name(x.dtype)}")
    if not _in(x.dim(), RMS_NORM_DIMS):
        raise _fail(op, f"self has {x.dim()} dims, not {RMS_NORM_DIMS[0]}..{RMS_NORM_DIMS[1]}")
    if gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise _fail(op, f"gamma shape {tuple(gamma.shape)} is not the trailing shape of self {tuple(x.shape)}")


def check_swiglu_call(x: torch.Tensor, dim: int) -> None:
    """Raise :class:`OpLimitError` where ``npu_swiglu(x, dim)`` is outside its documented limits."""
    op = "npu_swiglu"
    _check_dtype(op, "input", x.dtype)
    if not x.is_contiguous():
        raise _fail(op, "input must be contiguous")
    if x.numel() == 0:
        raise _fail(op, "input must not be empty")
    if not _in(x.dim(), SWIGLU_DIMS):
        raise _fail(op, f"input has {x.dim()} dims, not {SWIGLU_DIMS[0]}..{SWIGLU_DIMS[1]}")
    if not -x.dim() <= dim < x.dim():
        raise _fail(op, f"dim {dim} outside [{-x.dim()}, {x.dim() - 1}]")
    if x.shape[dim] % 2:
        raise _fail(op, f"size {x.shape[dim]} of dim {dim} must be even")


def _rotary_broadcast(r: torch.Tensor, x: torch.Tensor) -> int:
    """The product of the axes r1/r2 broadcast over (the documented "B*N")."""
    product = 1
    for r_size, x_size in zip(r.shape, x.shape):
        product *= x_size if r_size == 1 else 1
    return product


def check_rotary_mul_call(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> None:
    """Raise :class:`OpLimitError` where ``npu_rotary_mul(x, r1, r2)`` is outside its documented
    limits, for the one form polyfsdp calls: half mode, ``x`` in BNSD, r1/r2 as 11SD, B1SD or BNSD."""
    op = "npu_rotary_mul"
    if rotary_mode != "half":
        raise _fail(op, f"polyfsdp checks only rotary_mode 'half', got {rotary_mode!r}")
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        if t.dim() != 4:
            raise _fail(op, f"{name} must be 4-D, got {tuple(t.shape)}")
        _check_dtype(op, name, t.dtype)
    if r1.dtype != x.dtype or r2.dtype != x.dtype:
        raise _fail(op, f"r1/r2 dtype must equal input's ({_dtype_name(x.dtype)})")
    batch, heads, seq, head_dim = x.shape
    allowed = {(1, 1, seq, head_dim), (batch, 1, seq, head_dim), (batch, heads, seq, head_dim)}
    if r1.shape != r2.shape or tuple(r1.shape) not in allowed:
        raise _fail(op, f"r1 {tuple(r1.shape)} / r2 {tuple(r2.shape)} must be 11SD, B1SD or BNSD for a BNSD "
                        f"input {tuple(x.shape)}")
    if head_dim % 2 or head_dim >= ROPE_HEAD_DIM_BELOW:
        raise _fail(op, f"D {head_dim} must be even and below {ROPE_HEAD_DIM_BELOW}")
    if batch >= ROPE_BATCH_HEADS_BELOW or heads >= ROPE_BATCH_HEADS_BELOW:
        raise _fail(op, f"B {batch} and N {heads} must be below {ROPE_BATCH_HEADS_BELOW}")
    if torch.is_grad_enabled() and (r1.requires_grad or r2.requires_grad):
        broadcast = _rotary_broadcast(r1, x)
        if broadcast > ROPE_GRAD_BROADCAST:
            raise _fail(op, f"with gradients for r1/r2, B*N (the broadcast axes) must be <= {ROPE_GRAD_BROADCAST}, "
                            f"got {broadcast}")
    for name, t in (("r1", r1), ("r2", r2)):
        if t.numel() and t.detach().abs().max().item() > ROPE_VALUE_RANGE + 1e-6:
            raise _fail(op, f"{name} values must lie in [-1, 1]")


def _check_cumulative(name: str, ends, total: int) -> list[int]:
    op = "npu_fusion_attention"
    if ends is None:
        raise _fail(op, f"input_layout TND needs {name}")
    if isinstance(ends, torch.Tensor) or not isinstance(ends, (list, tuple)):
        raise _fail(op, f"{name} must be a host list of ints, got {type(ends).__name__}")
    ends = [int(e) for e in ends]
    if not ends or ends[0] < 0 or any(b < a for a, b in zip(ends, ends[1:])):
        raise _fail(op, f"{name} must be cumulative (non-decreasing) lengths, got {ends}")
    if ends[-1] != total:
        raise _fail(op, f"{name} must end at T={total}, got {ends}")
    if len(ends) > FA_VARLEN_SEQUENCES:
        raise _fail(op, f"{name} holds {len(ends)} sequences; TND takes at most {FA_VARLEN_SEQUENCES}")
    return ends


def _check_heads(op: str, head_num: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
    if head_num != q_heads:
        raise _fail(op, f"head_num {head_num} must equal the query heads {q_heads}")
    if not _in(q_heads, FA_QUERY_HEADS):
        raise _fail(op, f"query heads {q_heads} outside {FA_QUERY_HEADS[0]}..{FA_QUERY_HEADS[1]}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise _fail(op, f"query heads {q_heads} must be a multiple of key/value heads {kv_heads}")
    if not _in(head_dim, FA_HEAD_DIM):
        raise _fail(op, f"head dim {head_dim} outside {FA_HEAD_DIM[0]}..{FA_HEAD_DIM[1]}")


def _bnsd_sizes(t: torch.Tensor, layout: str, heads: int | None) -> tuple[int, int, int, int]:
    """(B, N, S, D) of a non-TND tensor; ``heads`` splits H for BSH/SBH (None: key/value, whose
    head count follows from the query's head dim, passed by the caller as ``heads``)."""
    if layout == "BNSD":
        return tuple(t.shape)
    if layout == "BSND":
        b, s, n, d = t.shape
        return b, n, s, d
    if layout == "BSH":
        b, s, h = t.shape
    else:  # SBH
        s, b, h = t.shape
    return b, heads, s, h // heads


def check_fusion_attention_call(query, key, value, head_num: int, input_layout: str, padding_mask=None,
                                atten_mask=None, keep_prob: float = 1.0, actual_seq_qlen=None,
                                actual_seq_kvlen=None, sparse_mode: int = 0) -> tuple[list[int], list[int]] | None:
    """Raise :class:`OpLimitError` where an ``npu_fusion_attention`` call is outside its documented
    limits; returns the checked (q, kv) cumulative ends for TND, else None."""
    op = "npu_fusion_attention"
    if input_layout not in FA_LAYOUTS:
        raise _fail(op, f"input_layout must be one of {FA_LAYOUTS}, got {input_layout!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_dtype(op, name, t.dtype)
    if not (query.dtype == key.dtype == value.dtype):
        raise _fail(op, f"query/key/value dtypes differ: {query.dtype}/{key.dtype}/{value.dtype}")
    if key.shape != value.shape:
        raise _fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if padding_mask is not None:
        raise _fail(op, "padding_mask is not supported yet")
    if not 0.0 < keep_prob <= 1.0:
        raise _fail(op, f"keep_prob must be in (0, 1], got {keep_prob}")
    if atten_mask is not None and atten_mask.dtype not in FA_MASK_DTYPES:
        raise _fail(op, f"atten_mask must be bool or uint8, got {atten_mask.dtype}")
    if sparse_mode in (2, 3, 4, 7, 8) and (atten_mask is None or tuple(atten_mask.shape) != FA_COMPRESSED_MASK):
        shape = None if atten_mask is None else tuple(atten_mask.shape)
        raise _fail(op, f"sparse_mode {sparse_mode} needs the compressed {FA_COMPRESSED_MASK} causal atten_mask, "
                        f"got {shape}")
    expected_dims = 3 if input_layout in ("BSH", "SBH", "TND") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != expected_dims:
            raise _fail(op, f"{input_layout}: {name} must be {expected_dims}-D, got {tuple(t.shape)}")
    if input_layout == "TND":
        t_q, n_q, d = query.shape
        t_kv, n_kv, d_kv = key.shape
        if d_kv != d:
            raise _fail(op, f"head dims differ: query {d}, key {d_kv}")
        _check_heads(op, head_num, n_q, n_kv, d)
        for total in (t_q, t_kv):
            if not _in(total, FA_TOKENS):
                raise _fail(op, f"TND token count {total} outside {FA_TOKENS[0]}..{FA_TOKENS[1]}")
        q_ends = _check_cumulative("actual_seq_qlen", actual_seq_qlen, t_q)
        kv_ends = _check_cumulative("actual_seq_kvlen", actual_seq_kvlen, t_kv)
        if len(q_ends) != len(kv_ends):
            raise _fail(op, f"actual_seq_qlen ({len(q_ends)}) and actual_seq_kvlen ({len(kv_ends)}) lengths differ")
        if atten_mask is not None and sparse_mode in (0, 1) and atten_mask.dim() != 2:
            raise _fail(op, f"TND takes only an SS atten_mask, got {tuple(atten_mask.shape)}")
        return q_ends, kv_ends
    if input_layout in ("BSH", "SBH") and query.shape[-1] % head_num:
        raise _fail(op, f"H={query.shape[-1]} is not divisible by head_num {head_num}")
    b, n_q, s_q, d = _bnsd_sizes(query, input_layout, head_num)
    kv_heads = key.shape[-1] // d if input_layout in ("BSH", "SBH") else None
    b_kv, n_kv, s_kv, d_kv = _bnsd_sizes(key, input_layout, kv_heads)
    if b_kv != b or d_kv != d:
        raise _fail(op, f"key {tuple(key.shape)} does not match query {tuple(query.shape)} in {input_layout}")
    _check_heads(op, head_num, n_q, n_kv, d)
    if not _in(b, FA_BATCH):
        raise _fail(op, f"batch {b} outside {FA_BATCH[0]}..{FA_BATCH[1]}")
    for s in (s_q, s_kv):
        if not _in(s, FA_SEQ):
            raise _fail(op, f"sequence length {s} outside {FA_SEQ[0]}..{FA_SEQ[1]}")
    if atten_mask is not None and sparse_mode in (0, 1):
        allowed = [(b, n_q, s_q, s_kv), (b, 1, s_q, s_kv), (1, 1, s_q, s_kv), (s_q, s_kv)]
        if tuple(atten_mask.shape) not in allowed:
            raise _fail(op, f"atten_mask shape must be BNSS/B1SS/11SS/SS {allowed}, got {tuple(atten_mask.shape)}")
    return None
