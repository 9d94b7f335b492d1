"""EngineConfig.fuse_loss_into_head: an engine step with the loss inside the fused head's forward
equals the same step through the head's outputs (loss, metrics, every parameter gradient);
losses that do not declare themselves token-separable never take it."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_cases import masks_for
from tests.helpers.engine_reference import no_padding_batch, sequences
from tests.helpers.lora_cases import lora_engine, step_batch
from polyfsdp.engines.head import forward as fl
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import PPOLoss, SFTLoss, aggregate

LENGTHS = [6, 1, 12, 6, 6, 3, 9, 4]


def _batch(seed=31):
    seqs = sequences(LENGTHS, seed=seed)
    g = torch.Generator().manual_seed(seed)

    def near_policy():  # near the tiny model's log-probs (about -log 128), so some ratios clip
        return [-4.85 + 0.3 * torch.randn(len(s), generator=g) for s in seqs]

    per_token = {"response_mask": masks_for(seqs), "old_log_probs": near_policy(), "ref_log_probs": near_policy(),
                 "rollout_log_probs": near_policy(), "advantages": [torch.randn(len(s), generator=g) for s in seqs]}
    return no_padding_batch(seqs, per_token=per_token)


class SequenceSquaredNLL:
    """Not token-separable: the square of each sequence's summed NLL (a sequence-level loss)."""

    requires_entropy = False
    required_fields = ("response_mask",)

    def __call__(self, inputs):
        mask = inputs.fields["response_mask"]
        per_seq = aggregate(-inputs.log_probs, mask, inputs, "seq-mean-token-sum")
        return per_seq.square(), {"per_seq": per_seq.detach()}


@pytest.fixture
def head_calls(monkeypatch):
    """How often the engine entered the loss-in-forward head."""
    calls = []
    real = fl.fused_logprob_loss

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fl, "fused_logprob_loss", spy)
    return calls


def _step(engine, batch, loss_fn, temperature):
    sums = engine.forward_backward(batch, loss_fn, temperature)
    grads = {name: p.grad.detach().clone() for name, p in engine.module.named_parameters() if p.grad is not None}
    metrics = engine.optimizer_step()
    return sums, grads, metrics


def _assert_steps_equal(new, old):
    sums_new, grads_new, metrics_new = new
    sums_old, grads_old, metrics_old = old
    assert sorted(sums_new) == sorted(sums_old)
    for key in sums_old:  # the same loss on the same log-probs: bit for bit
        assert torch.equal(sums_new[key], sums_old[key]), key
    assert sorted(grads_new) == sorted(grads_old) and grads_old
    for name, old_g in grads_old.items():
        scale = float(old_g.abs().max())
        torch.testing.assert_close(grads_new[name], old_g, rtol=1e-5, atol=1e-6 * max(scale, 1e-12), msg=name)
    assert metrics_new.keys() == metrics_old.keys()
    for key in metrics_old:
        if key != "grad_norm":
            assert metrics_new[key] == metrics_old[key], key
    assert metrics_new["grad_norm"] == pytest.approx(metrics_old["grad_norm"], rel=1e-5)


def _two_engines(preset, **overrides):
    def build(on):
        config = EngineConfig(use_fused_kernels=True, fuse_loss_into_head=on, **overrides)
        return FSDPEngine(ModelConfig(preset=preset, seed=5), config, OptimConfig(lr=1e-3)).initialize()
    return build(True), build(False)


PPO_ALL_TERMS = dict(dual_clip_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.01)
CASES = [
    pytest.param("qwen2-tiny-tied", SFTLoss(agg_mode="seq-mean-token-mean"), "eager", None, id="sft-tied"),
    pytest.param("qwen2-tiny-tied", PPOLoss(agg_mode="token-mean", **PPO_ALL_TERMS), "eager", 12, id="ppo-micro"),
    pytest.param("gemma2-tiny", PPOLoss(agg_mode="seq-mean-token-sum-norm", agg_norm_tokens=8.0, **PPO_ALL_TERMS),
                 "eager", 12, id="ppo-softcap"),
    pytest.param("qwen2-tiny", PPOLoss(agg_mode="seq-mean-token-sum", on_policy=True, kl_coef=0.2, kl_type="k1",
                                       report_entropy=True), "compiled", 20, id="ppo-compiled"),
]


@pytest.mark.parametrize("preset,loss_fn,impl,budget", CASES)
def test_engine_step_with_the_loss_in_the_head_equals_todays_step(head_calls, preset, loss_fn, impl, budget):
    new, old = _two_engines(preset, fused_kernel_impl=impl, max_tokens_per_micro_batch=budget)
    batch = _batch()
    temperature = torch.linspace(0.7, 1.3, len(LENGTHS))
    stepped_new = _step(new, batch, loss_fn, temperature)
    assert head_calls  # the new engine did take the loss-in-head path
    calls_before = len(head_calls)
    stepped_old = _step(old, batch, loss_fn, temperature)
    assert len(head_calls) == calls_before  # and the switched-off one did not
    _assert_steps_equal(stepped_new, stepped_old)
    assert (new.head.softcap is not None) == (preset == "gemma2-tiny")  # the soft-cap case has one


def test_lora_gradients_reach_only_the_adapters_and_equal_todays(head_calls):
    new = lora_engine(use_fused_kernels=True, fuse_loss_into_head=True)
    old = lora_engine(use_fused_kernels=True, fuse_loss_into_head=False)
    batch = step_batch(0)
    stepped_new, stepped_old = _step(new, batch, SFTLoss(), 1.0), _step(old, batch, SFTLoss(), 1.0)
    assert head_calls
    assert all("lora_" in name for name in stepped_new[1])
    _assert_steps_equal(stepped_new, stepped_old)


def test_a_loss_that_is_not_token_separable_keeps_todays_path(head_calls):
    new, old = _two_engines("qwen2-tiny-tied", max_tokens_per_micro_batch=12)
    batch = _batch()
    stepped_new = _step(new, batch, SequenceSquaredNLL(), 1.0)
    assert not head_calls

    class Subclassed(SFTLoss):  # inherits the attribute but may change __call__: not trusted
        pass

    _step(new, batch, Subclassed(), 1.0)
    assert not head_calls
    _assert_steps_equal(stepped_new, _step(old, batch, SequenceSquaredNLL(), 1.0))


def test_gradients_accumulate_over_two_forward_backward_calls(head_calls):
    new, old = _two_engines("qwen2-tiny-tied")
    first, second = _batch(seed=31), _batch(seed=32)
    loss_fn = PPOLoss(**PPO_ALL_TERMS)

    def two_calls(engine):
        sums = [engine.forward_backward(batch, loss_fn) for batch in (first, second)]
        grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        per_call = {f"call{i}:{k}": v for i, call in enumerate(sums) for k, v in call.items()}
        return per_call, grads, engine.optimizer_step()

    stepped_new = two_calls(new)
    assert len(head_calls) == 2
    _assert_steps_equal(stepped_new, two_calls(old))


def test_a_bfloat16_head_keeps_todays_four_gemm_path(head_calls):
    new, old = _two_engines("qwen2-tiny-tied", param_dtype="bfloat16")
    batch = _batch()
    stepped_new = _step(new, batch, SFTLoss(), 1.0)
    assert not head_calls  # fused_logprob_loss refuses low precision: the head applies the loss to its outputs
    stepped_old = _step(old, batch, SFTLoss(), 1.0)
    for key in stepped_old[0]:
        assert torch.equal(stepped_new[0][key], stepped_old[0][key]), key
    for name, g in stepped_old[1].items():  # the very same computation
        assert torch.equal(stepped_new[1][name], g), name
