"""The fused head's per-chunk work as ``torch.compile`` kernels, through the device backend's compiler
(``Backend.compile_backend``: inductor, i.e. C++ on CPU and Triton on GPU; torchair's on NPU).

Same contract as the eager chunk functions in :mod:`fused_logprob` (the reference): the GEMMs
stay where they are, only the elementwise/reduction work around them is compiled, so each
chunk costs one pass over its logits instead of several:

- forward: from logits ``y (m, V)`` the row logsumexp, the label's log-prob and (only when
  asked) the entropy, in one kernel;
- backward: from ``log_p`` of one vocabulary slice the gradient of the logits fed to the two
  gradient GEMMs (entropy term, one-hot label term, soft-cap derivative, dtype cast), in one
  kernel.

Shapes are compiled dynamic (``dynamic=True``): micro-batches of any token count and the last,
narrower vocabulary slice reuse one graph; torch still specialises sizes 0 and 1. Variants that
change the graph (entropy on/off, soft-cap on/off, dtype) are separate functions or guards, a
handful in all, far below dynamo's recompile limit.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _forward_stats(y: torch.Tensor, labels: torch.Tensor):
    """``(lse, label log-prob)`` per row of logits ``y (m, V)``; ``labels (m,)`` in range."""
    row_max = y.amax(dim=1, keepdim=True)
    lse = (row_max + torch.exp(y - row_max).sum(dim=1, keepdim=True).log()).squeeze(1)
    return lse, y.gather(1, labels.unsqueeze(1)).squeeze(1) - lse


def _forward_stats_entropy(y: torch.Tensor, labels: torch.Tensor):
    """``(lse, label log-prob, entropy)``; entropy ``log s - sum(e * (y - max)) / s`` with
    ``e = exp(y - max)``, ``s = sum(e)``: every term is relative to the row max (no cancellation
    between two large numbers)."""
    row_max = y.amax(dim=1, keepdim=True)
    shifted = y - row_max
    e = torch.exp(shifted)
    s = e.sum(dim=1, keepdim=True)
    log_s = s.log()
    entropy = (log_s - (e * shifted).sum(dim=1, keepdim=True) / s).squeeze(1)
    lse = (row_max + log_s).squeeze(1)
    return lse, y.gather(1, labels.unsqueeze(1)).squeeze(1) - lse, entropy


def _one_hot(log_p: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(log_p.shape[1], device=log_p.device)
    return cols.unsqueeze(0) == local_labels


def _p_minus_one_hot(log_p, local_labels):
    """No entropy: ``p - onehot`` (the row factor ``-d`` is applied outside, as in eager)."""
    return torch.exp(log_p) - _one_hot(log_p, local_labels).to(log_p.dtype)


def _entropy_and_label_grad(log_p, local_labels, c1, c0, d):
    """``p * (c1 * log p + c0) + d * onehot`` (fused_logprob._backward derives the factors)."""
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    return torch.exp(log_p) * (c1 * log_p + c0) + torch.where(_one_hot(log_p, local_labels), d, zero)


def _store(log_p, grad, out_dtype: torch.dtype):
    """The gradient in ``out_dtype``: written over ``log_p``'s buffer when the dtypes agree (as
    the eager kernels do: no fresh (n, width) allocation and page faults per slice), else cast."""
    if out_dtype == log_p.dtype:
        return log_p.copy_(grad)
    return grad.to(out_dtype)


# The compiled entry points, one per variant so each code object keeps few cached graphs
# (dynamo's recompile limit counts per function). Soft-cap multiplies by the elementwise
# part of dy/dz, ``1 - tanh^2``.
def _grad_logits(log_p, local_labels, out_dtype: torch.dtype):
    return _store(log_p, _p_minus_one_hot(log_p, local_labels), out_dtype)


def _grad_logits_softcap(log_p, local_labels, tanh, out_dtype: torch.dtype):
    return _store(log_p, _p_minus_one_hot(log_p, local_labels) * (1.0 - tanh * tanh), out_dtype)


def _grad_logits_entropy(log_p, local_labels, c1, c0, d, out_dtype: torch.dtype):
    return _store(log_p, _entropy_and_label_grad(log_p, local_labels, c1, c0, d), out_dtype)


def _grad_logits_entropy_softcap(log_p, local_labels, c1, c0, d, tanh, out_dtype: torch.dtype):
    return _store(log_p, _entropy_and_label_grad(log_p, local_labels, c1, c0, d) * (1.0 - tanh * tanh), out_dtype)


class CompiledChunkKernels:
    """The chunk functions above, each compiled lazily on first use.

    ``fallback_to_eager``: for backends that only *may* compile (declared by the backend), a
    failing compilation logs one line and every later call runs the eager expression of the
    same function (same numbers, uncompiled). Otherwise a compile error propagates.
    """

    def __init__(self, fallback_to_eager: bool = False, backend: str | object = "inductor") -> None:
        self.fallback_to_eager = fallback_to_eager
        self.backend = backend
        self.failed: str | None = None
        self._compiled: dict[str, object] = {}

    def _call(self, fn, *args):
        if self.failed is not None:
            return fn(*args)
        compiled = self._compiled.get(fn.__name__)
        if compiled is None:
            compiled = self._compiled[fn.__name__] = torch.compile(fn, dynamic=True, fullgraph=True,
                                                                   backend=self.backend)
        try:
            return compiled(*args)
        except Exception as exc:  # a missing toolchain surfaces as any of several error types
            if not self.fallback_to_eager:
                raise
            self.failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            logger.warning("fused head: torch.compile failed on this backend (%s); using the eager chunk "
                           "kernels from now on", self.failed)
            return fn(*args)

    # The eager kernels' signatures (fused_logprob.EagerChunkKernels); no scratch buffers needed.
    needs_scratch = False

    def forward_stats(self, y, labels, return_entropy: bool, scratch=None):
        if return_entropy:
            return self._call(_forward_stats_entropy, y, labels)
        return (*self._call(_forward_stats, y, labels), None)

    def grad_logits(self, log_p, labels, valid, v0, c1, c0, d, tanh, out_dtype, scratch=None):
        # The label's column inside this slice, -1 where it lies outside or is ignored.
        width = log_p.shape[1]
        in_slice = valid & (labels >= v0) & (labels < v0 + width)
        local = torch.where(in_slice, labels - v0, torch.full_like(labels, -1)).unsqueeze(1)
        if c1 is None:
            if tanh is None:
                return self._call(_grad_logits, log_p, local, out_dtype)
            return self._call(_grad_logits_softcap, log_p, local, tanh, out_dtype)
        if tanh is None:
            return self._call(_grad_logits_entropy, log_p, local, c1, c0, d.unsqueeze(1), out_dtype)
        return self._call(_grad_logits_entropy_softcap, log_p, local, c1, c0, d.unsqueeze(1), tanh, out_dtype)


_KERNELS: dict[tuple, CompiledChunkKernels] = {}
# torch.compile's backend for the kernels: the device backend's (``Backend.compile_backend``),
# set by resolve_fused_kernel_impl when it picks "compiled"; one process has one device backend.
_compiler: object = "inductor"


def compiled_kernels(fallback_to_eager: bool = False) -> CompiledChunkKernels:
    """The process-wide compiled kernels (one per fallback setting and compiler: a fallback,
    once taken, sticks)."""
    key = (fallback_to_eager, _compiler)
    if key not in _KERNELS:
        _KERNELS[key] = CompiledChunkKernels(fallback_to_eager, backend=_compiler)
    return _KERNELS[key]


def resolve_fused_kernel_impl(requested: str, backend) -> tuple[str, bool]:
    """``EngineConfig.fused_kernel_impl`` on ``backend`` -> ``(impl, compile_fallback)`` for
    :func:`fused_logprob_entropy`. ``auto`` compiles where the backend declares it may and
    ``compile_by_default`` (GPUs, NPUs; not the CPU, where compiling outlasts a small job's head);
    ``compiled`` on a backend that cannot raises ConfigFieldError with the backend's reason."""
    from ..config import ConfigFieldError

    reason = backend.compile_unsupported()
    if requested == "eager" or (requested == "auto" and (reason is not None or not backend.compile_by_default)):
        return "eager", False
    if reason is not None:
        raise ConfigFieldError("EngineConfig", "fused_kernel_impl", f"'compiled' is not available: {reason}")
    global _compiler
    _compiler = backend.compile_backend()
    return "compiled", bool(backend.compile_may_fail)
