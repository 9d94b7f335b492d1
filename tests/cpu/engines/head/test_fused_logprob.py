"""The fused log-prob/entropy op against an independent full-logits float64 reference."""
from __future__ import annotations

import math

import pytest
import torch

from polyfsdp.engines.head import fused as fl
from polyfsdp.engines.head.fused import default_chunk_size, fused_logprob_entropy


def reference(hidden, weight, labels, temperature=1.0, softcap=None, ignore_index=-100):
    """Full (N, V) logits in float64: logits -> softcap -> / T -> log_softmax."""
    z = hidden.double() @ weight.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    log_p = torch.log_softmax(z / t, dim=-1)
    valid = labels != ignore_index
    lp = log_p.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    ent = -(log_p.exp() * log_p).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def make(n, h, v, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5 * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


def grads(fn, hidden, weight, g_lp, g_ent):
    """(log_probs, entropy, grad_hidden, grad_weight) for loss sum(g_lp*lp) + sum(g_ent*ent)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = fn(h, w)
    loss = (lp * g_lp.to(lp.dtype)).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad


GRADCHECK_CASES = [
    # (which outputs feed the loss, temperature kind, softcap)
    ("log_probs", "scalar", None),
    ("entropy", "scalar", None),
    ("both", "scalar", None),
    ("log_probs", "per_token", None),
    ("entropy", "per_token", None),
    ("both", "per_token", None),
    ("both", "scalar", 2.0),
    ("both", "per_token", 1.5),
]


@pytest.mark.parametrize("outputs,temp_kind,softcap", GRADCHECK_CASES)
def test_gradcheck_float64(outputs, temp_kind, softcap):
    n, h, v = 5, 3, 7
    hidden, weight, labels = make(n, h, v, torch.float64, seed=1)
    labels[2] = -100
    temperature = 0.7 if temp_kind == "scalar" else torch.linspace(0.5, 1.6, n, dtype=torch.float64)

    def fn(hh, ww):
        lp, ent = fused_logprob_entropy(hh, ww, labels, temperature=temperature, chunk_size=4,
                                        softcap=softcap, return_entropy=outputs != "log_probs")
        return {"log_probs": (lp,), "entropy": (ent,), "both": (lp, ent)}[outputs]

    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_()))


# The chunk kernels: eager (the reference implementation) and torch.compile'd
# (engines/head/fused_compiled.py), held to the same references and tolerances.
IMPLS = ["eager", "compiled"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temp_kind,softcap,return_entropy", [
    ("scalar", None, True), ("per_token", None, True), ("scalar", None, False),
    ("per_token", 4.0, True), ("scalar", 4.0, False)])
def test_float32_matches_full_logits_reference(temp_kind, softcap, return_entropy, impl):
    # Tolerance: log-probs and entropy depend on logits of magnitude <= ~15 that the float32
    # GEMM gets right to a few ulps (~1e-6); 2e-5 absolute leaves ~10x headroom. Gradients
    # sum N (or V) such terms, so they are compared relative to their own scale (2e-5).
    n, h, v = 70, 24, 301  # chunk 16 -> 5 forward chunks, 8 ragged backward slices
    hidden, weight, labels = make(n, h, v, seed=2)
    labels[[0, 33]] = -100
    temperature = 0.8 if temp_kind == "scalar" else torch.rand(n, generator=torch.Generator().manual_seed(3)) + 0.5
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    g_ent = g_ent if return_entropy else None
    lp, ent, gh, gw = grads(lambda a, b: fused_logprob_entropy(
        a, b, labels, temperature=temperature, chunk_size=16, softcap=softcap,
        return_entropy=return_entropy, impl=impl), hidden, weight, g_lp, g_ent)
    rlp, rent, rgh, rgw = grads(lambda a, b: reference(a, b, labels, temperature, softcap),
                                hidden.double(), weight.double(), g_lp.double(),
                                None if g_ent is None else g_ent.double())
    assert lp.dtype == torch.float32 and lp.shape == (n,)
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=2e-5)
    assert lp[0] == 0 and lp[33] == 0
    if return_entropy:
        assert ent.dtype == torch.float32
        torch.testing.assert_close(ent.double(), rent, rtol=0, atol=2e-5)
        assert ent[0] == 0 and ent[33] == 0
    else:
        assert ent is None
    for ours, ref in ((gh, rgh), (gw, rgw)):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())
    assert torch.all(gh[[0, 33]] == 0)


def test_chunk_size_does_not_change_results():
    hidden, weight, labels = make(33, 8, 50, seed=5)
    outs = [fused_logprob_entropy(hidden, weight, labels, chunk_size=c) for c in (1, 7, 33, 1000, None)]
    rlp, rent = reference(hidden, weight, labels)
    for lp, ent in outs:
        torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent.double(), rent, rtol=0, atol=1e-5)


def test_ignored_positions_give_zero_and_no_gradient():
    n, h, v = 20, 8, 31
    hidden, weight, labels = make(n, h, v, seed=6)
    ignored = torch.tensor([0, 5, 19])
    labels[ignored] = -1
    g = torch.Generator().manual_seed(7)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent, gh, gw = grads(lambda a, b: fused_logprob_entropy(a, b, labels, ignore_index=-1, chunk_size=6),
                            hidden, weight, g_lp, g_ent)
    assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert torch.all(gh[ignored] == 0)
    # The weight gradient equals the one computed on the kept rows alone.
    keep = torch.ones(n, dtype=torch.bool)
    keep[ignored] = False
    _, _, _, rgw = grads(lambda a, b: reference(a, b, labels[keep]), hidden[keep].double(),
                         weight.double(), g_lp[keep].double(), g_ent[keep].double())
    torch.testing.assert_close(gw.double(), rgw, rtol=0, atol=2e-5 * rgw.abs().max().item())
    rlp, rent = reference(hidden, weight, labels, ignore_index=-1)
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_match_float32_reference(dtype, impl):
    # The GEMM output is rounded once to the input dtype (unit roundoff u = 2^-8 for
    # bfloat16, 2^-11 for float16) before the float32 softmax, as a model's own lm_head does:
    # log p_l = y_l - lse moves by at most u*|y_l| + u*max|y| <= 2u*max|y|. The gradient GEMM
    # operands are rounded the same way, so gradients get 3% of their own scale.
    n, h, v = 40, 32, 257
    hidden, weight, labels = make(n, h, v, dtype, seed=8)
    g = torch.Generator().manual_seed(9)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent, gh, gw = grads(lambda a, b: fused_logprob_entropy(a, b, labels, temperature=0.9, chunk_size=16,
                                                               impl=impl),
                            hidden, weight, g_lp, g_ent)
    rlp, rent, rgh, rgw = grads(lambda a, b: reference(a, b, labels, 0.9), hidden.double(),
                                weight.double(), g_lp.double(), g_ent.double())
    assert lp.dtype == ent.dtype == torch.float32
    assert gh.dtype == gw.dtype == dtype
    unit_roundoff = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    value_tol = 2 * unit_roundoff * (hidden.double() @ weight.double().t()).abs().max().item() / 0.9
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=value_tol)
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=value_tol)
    for ours, ref in ((gh, rgh), (gw, rgw)):
        torch.testing.assert_close(ours.double(), ref, rtol=0, atol=0.03 * ref.abs().max().item())


def test_zero_tokens():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    lp, ent = fused_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,) and lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, 8)
    assert torch.equal(weight.grad, torch.zeros(11, 8))


def test_tied_embedding_gradient_accumulates_both_uses():
    n, h, v = 12, 8, 23
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, v, (n,), generator=g)
    labels = torch.roll(ids, -1)
    table = torch.randn(v, h, generator=g)
    mix = torch.randn(h, h, generator=g) / h**0.5

    def loss_with(fn, dtype):
        emb = torch.nn.Embedding(v, h, dtype=dtype)
        with torch.no_grad():
            emb.weight.copy_(table)
        hidden = torch.tanh(emb(ids) @ mix.to(dtype))
        lp, ent = fn(hidden, emb.weight)
        (lp.sum() - 0.3 * ent.sum()).backward()
        return emb.weight.grad

    ours = loss_with(lambda a, b: fused_logprob_entropy(a, b, labels, chunk_size=5), torch.float32)
    ref = loss_with(lambda a, b: reference(a, b, labels), torch.float64)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


def test_entropy_work_skipped_when_not_requested(monkeypatch):
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = fl._entropy_terms, fl._entropy_backward_terms

    def count_fwd(*a, **k):
        calls["forward"] += 1
        return fwd(*a, **k)

    def count_bwd(*a, **k):
        calls["backward"] += 1
        return bwd(*a, **k)

    monkeypatch.setattr(fl, "_entropy_terms", count_fwd)
    monkeypatch.setattr(fl, "_entropy_backward_terms", count_bwd)
    hidden, weight, labels = make(10, 4, 13, seed=11)
    hidden.requires_grad_()
    lp, ent = fused_logprob_entropy(hidden, weight, labels, return_entropy=False, chunk_size=3)
    lp.sum().backward()
    assert ent is None and calls == {"forward": 0, "backward": 0}
    lp, ent = fused_logprob_entropy(hidden, weight, labels, return_entropy=True, chunk_size=3)
    assert calls["forward"] == 4  # one per token chunk
    lp.sum().backward()  # entropy unused by the loss: its backward terms are skipped too
    assert calls["backward"] == 0
    lp, ent = fused_logprob_entropy(hidden, weight, labels, chunk_size=3)
    ent.sum().backward()
    assert calls["backward"] > 0


def test_default_chunk_size_rule():
    assert default_chunk_size(10**6, 32768) == fl.CHUNK_BUFFER_BYTES // (4 * 32768)
    assert default_chunk_size(5, 32768) == 5
    assert default_chunk_size(10**6, 10**9) == 16


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"hidden": torch.zeros(3, 5)}, ValueError, "must share H"),
    ({"labels": torch.zeros(4, dtype=torch.long)}, ValueError, r"labels must have shape \(N,\) = \(3,\)"),
    ({"labels": torch.zeros(3)}, TypeError, "labels must be an integer tensor"),
    ({"hidden": torch.zeros(3, 4, dtype=torch.float64)}, TypeError, "same dtype"),
    ({"temperature": torch.ones(2)}, ValueError, r"shape \(N,\) = \(3,\)"),
    ({"temperature": torch.tensor([1.0, 0.0, 1.0])}, ValueError, "finite and > 0"),
    ({"temperature": -1.0}, ValueError, "finite and > 0; got -1.0"),
    ({"temperature": "hot"}, TypeError, "temperature must be a float or a tensor"),
    ({"chunk_size": 0}, ValueError, "chunk_size must be None or a positive int"),
    ({"softcap": -3.0}, ValueError, "softcap must be None or a positive finite number"),
    ({"labels": torch.tensor([0, 7, 1])}, ValueError, r"labels must lie in \[0, V=7\) or equal ignore_index=-100; "
                                                       r"got labels\[1\] = 7"),
    ({"labels": torch.tensor([0, -1, 1])}, ValueError, r"got labels\[1\] = -1"),
])
def test_bad_inputs_raise_clear_errors(kwargs, exc, match):
    args = {"hidden": torch.zeros(3, 4), "weight": torch.zeros(7, 4), "labels": torch.zeros(3, dtype=torch.long)}
    opts = {}
    for key, value in kwargs.items():
        (args if key in args else opts)[key] = value
    with pytest.raises(exc, match=match):
        fused_logprob_entropy(args["hidden"], args["weight"], args["labels"], **opts)


def test_unfused_helper_rejects_labels_outside_the_vocabulary():
    # clamp(min=0) used to turn a stray -1 into class 0's log-prob silently.
    from polyfsdp.engines.head.forward import logprob_entropy_from_logits

    logits = torch.zeros(3, 7)
    for bad in (torch.tensor([0, -1, 1]), torch.tensor([0, 7, 1])):
        with pytest.raises(ValueError, match=r"labels must lie in \[0, V=7\) or equal ignore_index=-100"):
            logprob_entropy_from_logits(logits, bad, 1.0)
    log_probs, _ = logprob_entropy_from_logits(logits, torch.tensor([0, -100, 6]), 1.0)
    assert torch.allclose(log_probs, torch.tensor([-math.log(7), 0.0, -math.log(7)]))
