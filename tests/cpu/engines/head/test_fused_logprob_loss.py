"""The loss inside the fused head's forward (3 GEMMs) against today's path: the fused head's
outputs, then the loss, then autograd through the head's own 4-GEMM backward."""
from __future__ import annotations

import pytest
import torch

from polyfsdp.engines.head.fused import fused_logprob_entropy
from polyfsdp.engines.head.fused_loss import fused_logprob_loss
from polyfsdp.engines.losses.inputs import LossInputs
from polyfsdp.engines.losses import AGG_MODES, PPO_AGG_MODES, PPOLoss, SFTLoss, is_token_separable

SEQ_LENS = (9, 1, 14, 6, 11)  # N = 41 tokens: several chunks of 8 with a ragged last one
H, V, CHUNK = 8, 50, 8


def _batch(seed=0, seq_lens=SEQ_LENS, h=H, v=V):
    g = torch.Generator().manual_seed(seed)
    n = sum(seq_lens)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 3
    labels = torch.randint(0, v, (n,), generator=g)
    offsets = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    labels[offsets[1:] - 1] = -100  # the last position of every sequence has no next token
    mask = (torch.rand(n, generator=g) > 0.3).float()
    mask[offsets[1:] - 1] = 0.0
    mask[offsets[1]:offsets[2]] = 0.0  # a sequence without response tokens
    fields = {"response_mask": mask,
              "old_log_probs": -3.0 + 0.5 * torch.randn(n, generator=g),
              "rollout_log_probs": -3.0 + 0.5 * torch.randn(n, generator=g),
              "ref_log_probs": -3.0 + 0.5 * torch.randn(n, generator=g),
              "advantages": torch.randn(n, generator=g)}
    temperature = 0.6 + torch.rand(n, generator=g)
    return hidden, weight, labels, offsets, fields, temperature


def _loss_of(loss_fn, fields, offsets):
    # Global counts as if this were one micro-batch of several (larger than the local ones).
    def loss_of(log_probs, entropy):
        inputs = LossInputs(log_probs=log_probs, entropy=entropy, fields=fields, offsets=offsets,
                            global_num_tokens=float(fields["response_mask"].sum()) + 7.0,
                            global_num_seqs=offsets.numel() + 2)
        return loss_fn(inputs)
    return loss_of


def _run(loss_fn, fused_in_forward, impl, temperature_kind, softcap, seed=0):
    hidden, weight, labels, offsets, fields, temperature = _batch(seed)
    temperature = temperature if temperature_kind == "per_token" else 0.8
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss_of = _loss_of(loss_fn, fields, offsets)
    need_entropy = loss_fn.requires_entropy
    kwargs = dict(temperature=temperature, return_entropy=need_entropy, chunk_size=CHUNK, softcap=softcap, impl=impl)
    if fused_in_forward:
        loss, metrics, _, _ = fused_logprob_loss(h, w, labels, loss_of, **kwargs)
    else:
        lp, ent = fused_logprob_entropy(h, w, labels, **kwargs)
        loss, metrics = loss_of(lp, ent)
    (loss * 0.5).backward()  # an upstream gradient other than 1
    return loss.detach(), metrics, h.grad, w.grad


def _ppo_variants(agg):
    norm = {"agg_norm_tokens": 16.0} if agg == "seq-mean-token-sum-norm" else {}
    return [
        PPOLoss(agg_mode=agg, **norm),
        PPOLoss(agg_mode=agg, dual_clip_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.01, **norm),
        PPOLoss(agg_mode=agg, on_policy=True, kl_coef=0.2, kl_type="k1", report_entropy=True, **norm),
    ]


LOSSES = [pytest.param(SFTLoss(agg_mode=a), id=f"sft-{a}") for a in AGG_MODES] + [
    pytest.param(loss, id=f"ppo{i}-{a}") for a in PPO_AGG_MODES for i, loss in enumerate(_ppo_variants(a))]


def _assert_same(new, old):
    loss_new, metrics_new, gh_new, gw_new = new
    loss_old, metrics_old, gh_old, gw_old = old
    torch.testing.assert_close(loss_new, loss_old, rtol=0, atol=0)
    assert sorted(metrics_new) == sorted(metrics_old)
    for key in metrics_old:  # the same loss on the same log-probs: bit for bit
        torch.testing.assert_close(metrics_new[key], metrics_old[key], rtol=0, atol=0, msg=key)
    for new_g, old_g in ((gh_new, gh_old), (gw_new, gw_old)):
        scale = old_g.abs().max()
        assert scale > 0
        torch.testing.assert_close(new_g, old_g, rtol=1e-5, atol=1e-6 * float(scale))


@pytest.mark.parametrize("impl", ["eager", "compiled"])
@pytest.mark.parametrize("loss_fn", LOSSES)
def test_loss_in_forward_equals_todays_path(loss_fn, impl):
    assert is_token_separable(loss_fn)
    _assert_same(_run(loss_fn, True, impl, "per_token", None), _run(loss_fn, False, impl, "per_token", None))


@pytest.mark.parametrize("impl", ["eager", "compiled"])
@pytest.mark.parametrize("temperature_kind,softcap", [("scalar", None), ("scalar", 2.5), ("per_token", 1.5)])
@pytest.mark.parametrize("loss_fn", [pytest.param(SFTLoss(), id="sft"),
                                     pytest.param(_ppo_variants("seq-mean-token-mean")[1], id="ppo-all-terms")])
def test_temperature_and_softcap(loss_fn, impl, temperature_kind, softcap):
    _assert_same(_run(loss_fn, True, impl, temperature_kind, softcap),
                 _run(loss_fn, False, impl, temperature_kind, softcap))


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    hidden, weight, labels, offsets, fields, temperature = _batch()
    h = hidden.clone().requires_grad_()
    loss, _, _, _ = fused_logprob_loss(h, weight, labels, _loss_of(SFTLoss(), fields, offsets), chunk_size=CHUNK)
    loss.backward()
    assert weight.grad is None and h.grad is not None and h.grad.abs().sum() > 0


def test_a_second_backward_is_refused_with_the_fix():
    hidden, weight, labels, offsets, fields, _ = _batch()
    h = hidden.clone().requires_grad_()
    loss, _, _, _ = fused_logprob_loss(h, weight, labels, _loss_of(SFTLoss(), fields, offsets), chunk_size=CHUNK)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="supports one backward.*run the forward again"):
        loss.backward()


def test_outputs_equal_todays_log_probs_and_entropy():
    hidden, weight, labels, offsets, fields, temperature = _batch()
    loss_of = _loss_of(PPOLoss(entropy_coef=0.1), fields, offsets)
    _, _, lp, ent = fused_logprob_loss(hidden, weight, labels, loss_of, temperature=temperature, chunk_size=CHUNK)
    lp_ref, ent_ref = fused_logprob_entropy(hidden, weight, labels, temperature=temperature, chunk_size=CHUNK)
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)


def test_low_precision_is_refused_with_the_fix():
    hidden, weight, labels, offsets, fields, _ = _batch()
    with pytest.raises(TypeError, match="use fused_logprob_entropy"):
        fused_logprob_loss(hidden.bfloat16(), weight.bfloat16(), labels, _loss_of(SFTLoss(), fields, offsets))


def test_separability_is_declared_by_the_loss_class_itself():
    class Rescaled(SFTLoss):  # may change __call__ arbitrarily: must declare separability again
        pass

    class NotALoss:
        def __call__(self, inputs):
            raise AssertionError

    assert is_token_separable(SFTLoss()) and is_token_separable(PPOLoss())
    assert not is_token_separable(Rescaled()) and not is_token_separable(NotALoss())
    assert not is_token_separable(lambda inputs: None)


def _full_logits_float64(hidden, weight, labels, temperature, softcap):
    """Per-token (log-prob, entropy) from whole float64 logits, by plain autograd."""
    z = hidden @ weight.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature[:, None], dim=-1)
    valid = labels != -100
    zero = torch.zeros((), dtype=z.dtype)
    lp = torch.where(valid, log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), zero)
    return lp, torch.where(valid, -(log_p.exp() * log_p).sum(-1), zero)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("loss_fn", [pytest.param(SFTLoss(agg_mode="seq-mean-token-mean"), id="sft"),
                                     pytest.param(_ppo_variants("seq-mean-token-sum")[1], id="ppo-all-terms")])
def test_float64_gradients_equal_whole_logits_autograd(loss_fn, softcap):
    # An independent reference: no chunks, no hand-derived logits gradient. (The losses compute
    # in float32, so finite differences cannot check them; autograd through them can.)
    hidden, weight, labels, offsets, fields, temperature = _batch(seed=4)
    loss_of = _loss_of(loss_fn, fields, offsets)
    h64, w64, t64 = hidden.double(), weight.double(), temperature.double()
    got = [h64.clone().requires_grad_(), w64.clone().requires_grad_()]
    loss, metrics, _, _ = fused_logprob_loss(*got, labels, loss_of, temperature=t64, chunk_size=CHUNK, softcap=softcap,
                                             return_entropy=loss_fn.requires_entropy)
    loss.backward()
    ref = [h64.clone().requires_grad_(), w64.clone().requires_grad_()]
    lp, ent = _full_logits_float64(*ref, labels, t64, softcap)
    ref_loss, ref_metrics = loss_of(lp, ent if loss_fn.requires_entropy else None)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=1e-7)
    for key in ref_metrics:
        torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=1e-6, atol=1e-7, msg=key)
    for new, old in zip(got, ref):
        scale = float(old.grad.abs().max())
        assert scale > 0
        torch.testing.assert_close(new.grad, old.grad, rtol=1e-5, atol=1e-6 * scale)
