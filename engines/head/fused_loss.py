"""The fused head with a token-separable loss inside it: three GEMMs, logits never kept.

:func:`fused_logprob_entropy` (the memory-light head) runs four GEMMs for forward+backward:
its backward recomputes every chunk's logits, because the loss is unknown in the forward.
When the loss is *token-separable* (a sum over tokens of a function of that token's log-prob,
entropy and per-token fields, with normalisers fixed before the step: every loss and
aggregation mode of :mod:`losses` declares it with ``token_separable = True``), the gradient
w.r.t. token ``n``'s log-prob and entropy depends on token ``n`` alone. So right after a
chunk's forward, while its logits are still in the buffer:

1. the loss is differentiated w.r.t. the per-token log-probs and entropies (autograd on
   ``(N,)`` tensors; rows not computed yet hold 0 and their gradients are discarded, which
   separability makes harmless);
2. the chunk's logits gradient is formed in place (the same chunk kernels, eager or compiled,
   and the same row factors as the four-GEMM backward: :func:`fused_logprob.logit_grad_factors`);
3. ``grad_hidden[rows] = g @ W`` and ``grad_weight += g.T @ hidden[rows]``.

GEMMs: the logits, then the two gradient GEMMs, per chunk. After the last chunk the loss is
evaluated once more on the final log-probs/entropies (no grad): its value and metrics are
exactly what the loss returns on the four-GEMM path's outputs. The backward only scales the
stored gradients by the upstream gradient. Full-precision heads only (float32/float64):
low-precision heads would accumulate ``grad_weight`` over token chunks in their own dtype,
so they keep the four-GEMM path (the caller, :mod:`forward_logprobs`, picks it).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from .fused import (_check_inputs, _Head, check_labels_on_host, default_chunk_size, kernels_for,
                            logit_grad_factors)

# ``loss_of(log_probs, entropy or None) -> (loss, metrics)``: the caller's loss on flat (N,) tensors.
LossOf = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]
FULL_PRECISION = (torch.float32, torch.float64)


def _per_token_grads(loss_of: LossOf, log_probs: torch.Tensor, entropy: torch.Tensor | None, rows: slice):
    """d loss / d (log-prob, entropy) at ``rows`` (None where the loss does not depend on it)."""
    with torch.enable_grad():
        lp = log_probs.detach().clone().requires_grad_()
        ent = None if entropy is None else entropy.detach().clone().requires_grad_()
        loss, _ = loss_of(lp, ent)
        leaves = [lp] if ent is None else [lp, ent]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else (None,) * len(leaves)
    g_lp = None if grads[0] is None else grads[0][rows]
    g_ent = None if ent is None or grads[1] is None else grads[1][rows]
    return g_lp, g_ent


class _FusedLogProbLoss(torch.autograd.Function):
    """Forward: per-token stats, the loss gradient and both input gradients, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, return_entropy, chunk_size, ignore_index, softcap,
                kernels, loss_of, need_h, need_w, outputs):
        n, v = hidden.shape[0], weight.shape[0]
        head = _Head(hidden, temperature, softcap)
        acc = head.acc_dtype
        dev = hidden.device
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).to(torch.int64)
        zero = torch.zeros((), dtype=acc, device=dev)
        log_probs = torch.zeros(n, dtype=acc, device=dev)
        entropy = torch.zeros(n, dtype=acc, device=dev) if return_entropy else None
        grad_hidden = torch.zeros(n, hidden.shape[1], dtype=acc, device=dev) if need_h else None
        grad_weight = torch.zeros(v, weight.shape[1], dtype=acc, device=dev) if need_w else None
        with torch.autocast(device_type=dev.type, enabled=False):
            if n > 0:
                chunk = min(chunk_size, n)
                flat = torch.empty(chunk * v, dtype=acc, device=dev)
                flat_lp = torch.empty_like(flat) if kernels.needs_scratch else None
                flat_t = torch.empty_like(flat) if softcap is not None else None
                for start in range(0, n, chunk):
                    rows = slice(start, min(start + chunk, n))
                    m = rows.stop - rows.start
                    y = head.logits(rows, weight, flat[: m * v].view(m, v),
                                    None if flat_t is None else flat_t[: m * v].view(m, v))
                    scratch = None if flat_lp is None else flat_lp[: m * v].view(m, v)
                    lse, label_lp, chunk_entropy = kernels.forward_stats(y, safe_labels[rows], return_entropy,
                                                                         scratch)
                    row_valid = valid[rows]
                    log_probs[rows] = torch.where(row_valid, label_lp, zero)
                    if return_entropy:
                        entropy[rows] = torch.where(row_valid, chunk_entropy, zero)
                    if need_h or need_w:
                        _chunk_grads(head, weight, hidden, rows, y, scratch, lse, safe_labels[rows], row_valid,
                                     log_probs, entropy, flat_t, loss_of, kernels, grad_hidden, grad_weight)
            loss, metrics = loss_of(log_probs, entropy)
        outputs["metrics"] = metrics
        outputs["log_probs"], outputs["entropy"] = log_probs, entropy
        # Kept on ctx (not saved tensors) so the backward can scale them in place and drop
        # them: a second (V, H) buffer would break the memory budget. Hence one backward only.
        ctx.grads = (grad_hidden, grad_weight)
        return loss.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("fused_logprob_loss: its loss supports one backward (the gradients were computed in "
                               "the forward and are handed over once); run the forward again instead of retain_graph")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        if grad_loss is None:
            return (None,) * 13
        # The loss is the output; its gradient only scales the stored input gradients.
        grad_hidden = None if grad_hidden is None else grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        grad_weight = None if grad_weight is None else grad_weight.mul_(grad_loss.to(grad_weight.dtype))
        return (grad_hidden, grad_weight) + (None,) * 11


def _chunk_grads(head, weight, hidden, rows, y, scratch, lse, labels, valid, log_probs, entropy, flat_t, loss_of,
                 kernels, grad_hidden, grad_weight):
    """This chunk's share of grad_hidden (written) and grad_weight (accumulated), from its logits ``y``."""
    m, v = y.shape
    zero = torch.zeros((), dtype=y.dtype, device=y.device)
    g_lp, g_ent = _per_token_grads(loss_of, log_probs, entropy, rows)
    g_lp = torch.zeros(m, dtype=y.dtype, device=y.device) if g_lp is None else torch.where(valid, g_lp, zero)
    if g_ent is not None:
        g_ent = torch.where(valid, g_ent, zero)
    d, c1, c0 = logit_grad_factors(head, g_lp, g_ent, None if entropy is None else entropy[rows], rows)
    if kernels.needs_scratch:
        # Eager kernels: log_softmax went to ``scratch``; ``y`` is free (it held exp(log p)).
        log_p, free = scratch, y
    else:
        log_p, free = y.sub_(lse.unsqueeze(1)), None
    tanh = None if flat_t is None else flat_t[: m * v].view(m, v)
    g = kernels.grad_logits(log_p, labels, valid, 0, c1, c0, d, tanh, y.dtype, free)
    h_rows = hidden[rows]
    row_factor = None if c1 is not None else (-d).unsqueeze(1)
    if grad_hidden is not None:
        out = grad_hidden[rows]
        torch.mm(g, weight, out=out)
        if row_factor is not None:
            out.mul_(row_factor)
    if grad_weight is not None:
        grad_weight.addmm_(g.t(), h_rows if row_factor is None else h_rows * row_factor)


def fused_logprob_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_of: LossOf, *,
                       temperature: float | torch.Tensor = 1.0, return_entropy: bool = True,
                       chunk_size: int | None = None, ignore_index: int = -100, softcap: float | None = None,
                       check_values: bool = True, impl: str = "eager", compile_fallback: bool = False):
    """``(loss, metrics, log_probs, entropy)`` of a token-separable ``loss_of`` over the fused head.

    Same head, arguments and conventions as :func:`fused_logprob.fused_logprob_entropy`; ``loss``
    carries the gradient to ``hidden`` and ``weight`` (computed in this forward), ``metrics``,
    ``log_probs`` and ``entropy`` are detached. ``loss_of`` must be token-separable (see the
    module docstring): a loss that is not gives wrong gradients here, so callers check
    :func:`loss_inputs.is_token_separable`. Float32/float64 inputs only.
    """
    _check_inputs(hidden, weight, labels, temperature, chunk_size, softcap, check_values)
    if hidden.dtype not in FULL_PRECISION:
        raise TypeError(f"fused_logprob_loss needs float32 or float64 inputs; got {hidden.dtype} "
                        "(use fused_logprob_entropy and apply the loss to its outputs)")
    n, v = hidden.shape[0], weight.shape[0]
    if check_values:
        check_labels_on_host(labels, v, int(ignore_index))
    if chunk_size is None:
        chunk_size = default_chunk_size(n, v)
    grad_on = torch.is_grad_enabled()
    outputs: dict = {}
    loss = _FusedLogProbLoss.apply(hidden, weight, labels, temperature, bool(return_entropy), int(chunk_size),
                                   int(ignore_index), softcap, kernels_for(impl, compile_fallback), loss_of,
                                   grad_on and hidden.requires_grad, grad_on and weight.requires_grad, outputs)
    return loss, outputs["metrics"], outputs["log_probs"], outputs["entropy"]
