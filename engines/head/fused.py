"""Fused LM head -> per-token log-prob and entropy, without a ``(tokens, vocab)`` logits tensor.

``fused_logprob_entropy(hidden, weight, labels)`` returns, for every token ``n``,
``log_softmax(y_n)[labels[n]]`` and the entropy of ``softmax(y_n)``, where the logits are

    z = hidden @ weight.T            (GEMM in the input dtype, float32 accumulation)
    s = cap * tanh(z / cap)          (only when ``softcap`` is given; Gemma-2 style)
    y = s / T                        (temperature: a float or one value per token)

Order ``logits -> softcap -> / T`` is what transformers and verl do together: Gemma2's
``final_logit_softcapping`` is applied inside the model forward, and verl's actor divides
the model's returned logits by the temperature (``logits.div_(temperature)``) afterwards.
Everything after the GEMM runs in float32. Low-precision inputs: the logits GEMM runs in
the input dtype (float32 accumulation inside the GEMM, output rounded once, exactly like
the model's own lm_head); gradient GEMMs run in bfloat16 for bfloat16 and in float32 for
float16 (whose range would flush tiny gradients to zero).

Ignored positions (``labels == ignore_index``) give log-prob 0 AND entropy 0, and pass no
gradient from either output (the log-prob convention wants the last position of each
sequence to be 0 for both; callers mark it with ``ignore_index``).

Memory: the forward walks the tokens in chunks of ``chunk_size`` rows (the whole vocabulary
per row) and keeps only per-token statistics (logsumexp, label logit, entropy). The
backward recomputes the logits in vocabulary slices holding the same number of elements
(``chunk_size * V``), so ``grad_weight`` rows are written once by one GEMM over all tokens
and only the small ``(N, H)`` ``grad_hidden`` is accumulated. Total work: four GEMMs
(forward, recompute, two gradient GEMMs); with a token-separable loss known in the forward,
:mod:`fused_logprob_loss` needs three. The working set is two float32 buffers of
``chunk_size * V`` elements in the forward; the backward holds one, plus one when an
entropy gradient is involved, plus one with soft-cap; see :func:`default_chunk_size` for
the rule. ``return_entropy=False`` skips all entropy work in forward and backward.
"""
from __future__ import annotations

import logging
import math

import torch
from torch.autograd.function import once_differentiable

logger = logging.getLogger(__name__)

# Bytes one float32 working buffer may take when ``chunk_size`` is None. Each forward chunk
# re-reads the whole weight, so fewer, larger chunks are faster (measured on CPU: 512-token
# chunks at V=32768 beat 128-token ones by ~15%); 64 MiB keeps the op's working set (two
# buffers, three with soft-cap) far below the naive path's logits, softmax and gradient.
CHUNK_BUFFER_BYTES = 64 * 2**20
_MIN_CHUNK_TOKENS = 16


def default_chunk_size(num_tokens: int, vocab_size: int, buffer_bytes: int = CHUNK_BUFFER_BYTES) -> int:
    """Tokens per forward chunk when ``chunk_size=None``.

    Rule: the largest count whose float32 logits ``(chunk, V)`` fit in ``buffer_bytes``
    (64 MiB: 512 tokens at V=32768, 110 at V=151936), at least 16, at most ``num_tokens``.
    """
    rows = max(_MIN_CHUNK_TOKENS, buffer_bytes // (4 * max(vocab_size, 1)))
    return int(max(1, min(rows, num_tokens)))


def _entropy_terms(log_p: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Per-row entropy ``-sum_j p_j log p_j`` from log-probs; the only forward entropy work."""
    return -torch.linalg.vecdot(torch.exp(log_p, out=scratch), log_p)


def _entropy_backward_terms(log_p: torch.Tensor, coef_log_p: torch.Tensor, coef_one: torch.Tensor,
                            out: torch.Tensor) -> torch.Tensor:
    """``coef_log_p * log_p + coef_one`` into ``out``: the entropy part of the logit gradient."""
    return torch.addcmul(coef_one, log_p, coef_log_p, out=out)


class EagerChunkKernels:
    """The per-chunk work between the GEMMs in plain torch ops: the reference implementation.

    ``forward_stats`` turns one chunk of logits into ``(lse, label log-prob, entropy or None)``;
    ``grad_logits`` turns one vocabulary slice of ``log_p`` into the logits gradient fed to the
    gradient GEMMs. Both work in place in the caller's buffers (``needs_scratch``: one more
    buffer of the chunk's size). :mod:`fused_logprob_compiled` offers the same two methods.
    """

    needs_scratch = True

    def forward_stats(self, y, labels, return_entropy: bool, scratch):
        row_max, arg_max = y.max(dim=1, keepdim=True)
        # One row-fused kernel (rows stay in cache) instead of sub/exp/sum passes. It writes
        # into a second buffer: in-place aliasing is not promised by every device's kernel;
        # the logits buffer then takes exp(log p).
        log_p = torch.log_softmax(y, dim=1, out=scratch)
        label_log_p = log_p.gather(1, labels[:, None]).squeeze(1)
        # lse = max - log p(argmax); |log p(argmax)| <= log V keeps its rounding tiny.
        lse = (row_max - log_p.gather(1, arg_max)).squeeze(1)
        return lse, label_log_p, (_entropy_terms(log_p, y) if return_entropy else None)

    def grad_logits(self, log_p, labels, valid, v0, c1, c0, d, tanh, out_dtype, scratch):
        n, width = log_p.shape
        zero = torch.zeros((), dtype=log_p.dtype, device=log_p.device)
        in_slice = valid & (labels >= v0) & (labels < v0 + width)
        if c1 is not None:
            q = _entropy_backward_terms(log_p, c1, c0, scratch)
            grad = log_p.exp_().mul_(q)
            src = torch.where(in_slice, d, zero).unsqueeze(1)
        else:
            grad = log_p.exp_()
            src = torch.where(in_slice, -torch.ones((), dtype=log_p.dtype, device=log_p.device), zero).unsqueeze(1)
        idx = (labels - v0).clamp_(0, width - 1).unsqueeze(1)
        grad.scatter_add_(1, idx, src)
        if tanh is not None:
            grad.mul_(tanh.square_().neg_().add_(1.0))
        return grad if grad.dtype == out_dtype else grad.to(out_dtype)


EAGER_KERNELS = EagerChunkKernels()
FUSED_KERNEL_IMPLS = ("eager", "compiled")


def check_labels_on_host(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise ValueError for a label outside ``[0, V)`` that is not ``ignore_index``. Only host
    labels are checked: on an accelerator the check would cost a host-device sync."""
    if not labels.is_cpu or labels.numel() == 0:
        return
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"labels must lie in [0, V={vocab_size}) or equal ignore_index={ignore_index}; "
                         f"got labels[{i}] = {int(labels[i])}")


def _check_inputs(hidden, weight, labels, temperature, chunk_size, softcap, check_values: bool = True):
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) \
            or not isinstance(labels, torch.Tensor):
        raise TypeError("hidden, weight and labels must be tensors; got "
                        f"{type(hidden).__name__}, {type(weight).__name__}, {type(labels).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (N, H); got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, H); got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, H) and weight (V, H) must share H; got hidden {tuple(hidden.shape)}"
                         f" and weight {tuple(weight.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must have shape (N,) = ({hidden.shape[0]},); got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor; got dtype {labels.dtype}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must have the same dtype; got {hidden.dtype} and {weight.dtype}")
    if hidden.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"hidden dtype must be float32, bfloat16, float16 or float64; got {hidden.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"hidden, weight and labels must be on one device; got {hidden.device}, "
                         f"{weight.device}, {labels.device}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be None or a positive int; got {chunk_size!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) \
                or not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap must be None or a positive finite number; got {softcap!r}")
    if isinstance(temperature, torch.Tensor):
        n = hidden.shape[0]
        if temperature.dim() > 1 or (temperature.dim() == 1 and temperature.shape[0] != n):
            raise ValueError(f"temperature tensor must be a scalar or have shape (N,) = ({n},); "
                             f"got {tuple(temperature.shape)}")
        if not temperature.is_floating_point():
            raise TypeError(f"temperature tensor must be floating point; got dtype {temperature.dtype}")
        if check_values and temperature.numel() and \
                not bool(torch.isfinite(temperature).all() and (temperature > 0).all()):
            raise ValueError("temperature must be finite and > 0 at every position; got min "
                             f"{temperature.min().item()!r}")
    elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float or a tensor; got {type(temperature).__name__}")
    elif not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0; got {temperature!r}")


class _Head:
    """How raw GEMM output ``z`` becomes logits ``y``: scale, optional soft-cap, per-row factors."""

    def __init__(self, hidden, temperature, softcap):
        self.softcap = softcap
        self.fp32 = hidden.dtype in (torch.float32, torch.float64)
        self.acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        if isinstance(temperature, torch.Tensor):
            inv_t = temperature.detach().to(device=hidden.device, dtype=self.acc_dtype).reciprocal()
            self.inv_t = inv_t.reshape(-1, 1) if inv_t.dim() == 1 else float(inv_t)
        else:
            self.inv_t = 1.0 / float(temperature)
        # ``pre`` scales z before the nonlinearity; ``post`` (soft-cap only) scales tanh.
        self.pre = (1.0 / softcap) if softcap is not None else self.inv_t
        self.post = softcap * self.inv_t if softcap is not None else None
        # Full-precision inputs fold a per-row ``pre`` into the hidden rows (cheap: N x H)
        # so every GEMM applies it for free.
        self.hidden = hidden
        if self.fp32 and isinstance(self.pre, torch.Tensor):
            self.gemm_hidden, self.gemm_alpha = hidden * self.pre, 1.0
        else:
            self.gemm_hidden, self.gemm_alpha = hidden, self.pre

    def logits(self, rows: slice, weight: torch.Tensor, out: torch.Tensor,
               tanh_out: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Write logits ``y (+ bias)`` for ``hidden[rows] @ weight.T`` into ``out``; return out.

        With soft-cap, ``tanh_out`` (if given) receives ``tanh(z / cap)`` for the backward.
        ``bias`` is an (n, 1) column added to y (folded into the GEMM when possible).
        """
        h = self.gemm_hidden[rows]
        t = out if tanh_out is None else tanh_out
        pre = self.pre if not isinstance(self.pre, torch.Tensor) else self.pre[rows]
        if self.fp32:
            if bias is not None and self.softcap is None:
                # The GEMM starts from the broadcast bias: saves a read-modify-write pass.
                return torch.addmm(bias.expand(t.shape), h, weight.t(), alpha=self.gemm_alpha, out=t)
            t.addmm_(h, weight.t(), beta=0.0, alpha=self.gemm_alpha)
        else:
            t.copy_(torch.mm(h, weight.t()))
            if isinstance(pre, torch.Tensor) or pre != 1.0:
                t.mul_(pre)
        if self.softcap is not None:
            t.tanh_()
            post = self.post if not isinstance(self.post, torch.Tensor) else self.post[rows]
            t = torch.mul(t, post, out=out)
        return t if bias is None else t.add_(bias)


class _FusedLogProbEntropy(torch.autograd.Function):
    """Forward keeps per-token statistics only; backward recomputes the logits slice by slice."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, return_entropy, chunk_size, ignore_index, softcap,
                kernels):
        ctx.set_materialize_grads(False)
        n, v = hidden.shape[0], weight.shape[0]
        head = _Head(hidden, temperature, softcap)
        acc = head.acc_dtype
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).to(torch.int64)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        label_log_p = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.empty(n, dtype=acc, device=hidden.device) if return_entropy else None
        with torch.no_grad(), torch.autocast(device_type=hidden.device.type, enabled=False):
            if n > 0:
                chunk = min(chunk_size, n)
                flat = torch.empty(chunk * v, dtype=acc, device=hidden.device)
                flat_lp = torch.empty_like(flat) if kernels.needs_scratch else None
                for start in range(0, n, chunk):
                    rows = slice(start, min(start + chunk, n))
                    m = rows.stop - rows.start
                    y = head.logits(rows, weight, flat[: m * v].view(m, v))
                    scratch = None if flat_lp is None else flat_lp[: m * v].view(m, v)
                    lse[rows], label_log_p[rows], chunk_entropy = kernels.forward_stats(
                        y, safe_labels[rows], return_entropy, scratch)
                    if return_entropy:
                        entropy[rows] = chunk_entropy
        zero = torch.zeros((), dtype=acc, device=hidden.device)
        log_probs = torch.where(valid, label_log_p, zero)
        if return_entropy:
            entropy = torch.where(valid, entropy, zero)
        ctx.save_for_backward(hidden, weight, safe_labels, valid, lse,
                              entropy if return_entropy else None)
        ctx.head_args = (temperature, softcap)
        ctx.kernels = kernels
        ctx.chunk_elems = max(1, min(chunk_size, n)) * v
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, valid, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_log_probs is None and grad_entropy is None) or not (need_h or need_w):
            return (None,) * 9
        temperature, softcap = ctx.head_args
        with torch.no_grad(), torch.autocast(device_type=hidden.device.type, enabled=False):
            grad_hidden, grad_weight = _backward(hidden, weight, labels, valid, lse, entropy,
                                                 grad_log_probs, grad_entropy, temperature, softcap,
                                                 ctx.chunk_elems, need_h, need_w, ctx.kernels)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def logit_grad_factors(head: "_Head", g_lp: torch.Tensor, g_ent: torch.Tensor | None,
                       entropy: torch.Tensor | None, rows: slice):
    """Per-row factors ``(d, c1, c0)`` of the gradient w.r.t. the raw GEMM output ``z`` of
    ``rows``, from the gradients ``g_lp``/``g_ent`` of those rows' log-prob and entropy.

    dL/dy_j = g_lp*(onehot_j - p_j) - g_ent*p_j*(y_j - E[y]) with y_j - E[y] = log p_j + H, and
    dy/dz = pre (no soft-cap) or inv_t * (1 - tanh^2) (soft-cap): the row part goes into the
    factors, the elementwise part is applied per slice. Hence dL/dz_j = p_j * (c1 * log p_j + c0)
    + d * onehot_j. Without entropy (``g_ent`` None) dL/dz = d * (onehot - p) and c1 = c0 = None:
    callers keep the row factor out of the slice (fold ``-d`` into the hidden rows for
    grad_weight and apply it to grad_hidden afterwards).
    """
    row_scale = head.inv_t if head.softcap is not None else head.pre
    row_scale = row_scale[rows].squeeze(1) if isinstance(row_scale, torch.Tensor) else row_scale
    d = g_lp * row_scale
    if g_ent is None:
        return d, None, None
    c1 = (-g_ent * row_scale).unsqueeze(1)
    c0 = (-(g_ent * entropy + g_lp) * row_scale).unsqueeze(1)
    return d, c1, c0


def _backward(hidden, weight, labels, valid, lse, entropy, g_lp, g_ent, temperature, softcap,
              chunk_elems, need_h, need_w, kernels):
    """Gradients for hidden and weight, recomputing the logits one vocabulary slice at a time."""
    n, v = hidden.shape[0], weight.shape[0]
    head = _Head(hidden, temperature, softcap)
    acc = head.acc_dtype
    dev = hidden.device
    zero = torch.zeros((), dtype=acc, device=dev)
    g_lp = torch.zeros(n, dtype=acc, device=dev) if g_lp is None else torch.where(valid, g_lp.to(acc), zero)
    use_ent = g_ent is not None
    if use_ent:
        g_ent = torch.where(valid, g_ent.to(acc), zero)
    d, c1, c0 = logit_grad_factors(head, g_lp, g_ent, entropy, slice(0, n))
    # bfloat16 keeps float32's exponent range, so its gradient GEMMs stay in bfloat16;
    # float16 would flush tiny p * g products to zero, so it runs them in float32.
    gemm_dtype = torch.float32 if hidden.dtype == torch.float16 else hidden.dtype
    h_for_w = hidden.to(gemm_dtype)
    if not use_ent:
        h_for_w = h_for_w * (-d).to(gemm_dtype).unsqueeze(1)
    grad_h_acc = torch.zeros(n, hidden.shape[1], dtype=acc, device=dev) if need_h else None
    if n == 0:
        return (grad_h_acc.to(hidden.dtype) if need_h else None,
                torch.zeros_like(weight) if need_w else None)
    grad_weight = torch.empty_like(weight) if need_w else None
    width = int(max(1, min(v, chunk_elems // max(n, 1))))
    nbuf_elems = n * width
    flat = torch.empty(nbuf_elems, dtype=acc, device=dev)
    flat_q = torch.empty_like(flat) if use_ent and kernels.needs_scratch else None
    flat_t = torch.empty_like(flat) if softcap is not None else None
    neg_lse = (-lse).unsqueeze(1)
    all_rows = slice(0, n)
    for v0 in range(0, v, width):
        v1 = min(v0 + width, v)
        w_cols = v1 - v0
        w_slice = weight[v0:v1]
        buf = flat[: n * w_cols].view(n, w_cols)
        tanh_buf = None if flat_t is None else flat_t[: n * w_cols].view(n, w_cols)
        log_p = head.logits(all_rows, w_slice, buf, tanh_buf, bias=neg_lse)
        q_scratch = None if flat_q is None else flat_q[: n * w_cols].view(n, w_cols)
        g_gemm = kernels.grad_logits(log_p, labels, valid, v0, c1, c0, d, tanh_buf, gemm_dtype, q_scratch)
        w_gemm = w_slice if w_slice.dtype == gemm_dtype else w_slice.to(gemm_dtype)
        if need_w:
            if grad_weight.dtype == gemm_dtype:
                torch.mm(g_gemm.t(), h_for_w, out=grad_weight[v0:v1])
            else:
                grad_weight[v0:v1] = torch.mm(g_gemm.t(), h_for_w)
        if need_h:
            if gemm_dtype == acc:
                grad_h_acc.addmm_(g_gemm, w_gemm)
            else:
                grad_h_acc.add_(torch.mm(g_gemm, w_gemm))
    grad_hidden = None
    if need_h:
        if not use_ent:
            grad_h_acc.mul_((-d).unsqueeze(1))
        grad_hidden = grad_h_acc.to(hidden.dtype)
    return grad_hidden, grad_weight


def fused_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          temperature: float | torch.Tensor = 1.0, return_entropy: bool = True,
                          chunk_size: int | None = None, ignore_index: int = -100,
                          softcap: float | None = None, check_values: bool = True,
                          impl: str = "eager", compile_fallback: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log p(labels)`` and entropy under ``softmax(softcap(hidden @ weight.T) / T)``.

    hidden (N, H), weight (V, H), labels (N,) int in [0, V) or ``ignore_index``;
    temperature a float or an (N,) tensor
    (a constant: it gets no gradient). Returns float32 ``(log_probs, entropy)`` of shape
    (N,) (float64 for float64 inputs), entropy None when ``return_entropy=False``;
    ignored labels give 0 in both. Gradients come back in the input dtypes.
    ``check_values=False`` skips the value checks that read tensors (labels, temperatures):
    for callers that validated them once already (the engine, at the batch edge).
    ``impl``: ``"eager"`` (plain torch ops, the reference) or ``"compiled"`` (the chunk work
    through ``torch.compile``, :mod:`fused_logprob_compiled`); ``compile_fallback=True`` turns a
    failing compilation into one logged line and the eager kernels (for backends that only may
    compile, e.g. the NPU).
    """
    _check_inputs(hidden, weight, labels, temperature, chunk_size, softcap, check_values)
    kernels = kernels_for(impl, compile_fallback)
    n, v = hidden.shape[0], weight.shape[0]
    if check_values:
        check_labels_on_host(labels, v, int(ignore_index))
    if chunk_size is None:
        chunk_size = default_chunk_size(n, v)
    return _FusedLogProbEntropy.apply(hidden, weight, labels, temperature, bool(return_entropy),
                                      int(chunk_size), int(ignore_index), softcap, kernels)


def kernels_for(impl: str, compile_fallback: bool = False):
    """The chunk kernels for ``impl`` (``"eager"`` or ``"compiled"``, see fused_logprob_entropy)."""
    if impl not in FUSED_KERNEL_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, FUSED_KERNEL_IMPLS))}; got {impl!r}")
    if impl == "compiled":
        from .fused_compiled import compiled_kernels

        return compiled_kernels(fallback_to_eager=bool(compile_fallback))
    return EAGER_KERNELS
