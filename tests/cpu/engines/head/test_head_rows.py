"""The LM head only where it is read (engines/head/rows.py): ``infer_batch(mask_field=)`` and a
loss declaring ``masked_positions_only`` give the whole head's numbers under the mask (0
elsewhere) in every pad mode, fused and unfused, with micro-batches and per-sequence
temperatures, and the head really sees only the masked rows. The reference is the same engine
with the whole head (no mask named; the loss opted out)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_cases import masks_for
from tests.helpers.engine_reference import left_right_batch, no_padding_batch, per_sequence, sequences
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.head import forward as head_forward
from polyfsdp.engines.losses import GSPOLoss, PPOLoss, SFTLoss, reads_masked_positions_only

LENGTHS = [6, 1, 12, 6, 6, 3, 9, 4]
MODES = [pytest.param(fused, rmpad, pad_mode, id=f"{'fused' if fused else 'unfused'}-"
                      f"{'rmpad' if rmpad else 'padded'}-{pad_mode}")
         for fused in (True, False) for rmpad in (True, False) for pad_mode in ("no_padding", "left_right")]


def _batch(pad_mode, seed=31):
    seqs = sequences(LENGTHS, seed=seed)
    g = torch.Generator().manual_seed(seed)
    near = lambda: [-4.85 + 0.3 * torch.randn(len(s), generator=g) for s in seqs]  # noqa: E731
    per_token = {"response_mask": masks_for(seqs), "old_log_probs": near(), "ref_log_probs": near(),
                 "rollout_log_probs": near(), "advantages": [torch.randn(len(s), generator=g) for s in seqs]}
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    return build(seqs, per_token=per_token), masks_for(seqs)


def _engine(fused, rmpad, pad_mode, budget=None, preset="qwen2-tiny"):
    config = EngineConfig(use_fused_kernels=fused, use_remove_padding=rmpad, pad_mode=pad_mode,
                          max_tokens_per_micro_batch=budget)
    return FSDPEngine(ModelConfig(preset=preset, seed=5), config, OptimConfig(lr=1e-3)).initialize()


@pytest.fixture
def head_rows(monkeypatch):
    """The number of rows each head call saw: the fused op's hidden rows, the unfused lm_head's inputs."""
    rows = []
    for name in ("fused_logprob_entropy", "fused_logprob_loss"):
        real = getattr(head_forward, name)

        def spy(hidden, *args, _real=real, **kwargs):
            rows.append(hidden.shape[0])
            return _real(hidden, *args, **kwargs)

        monkeypatch.setattr(head_forward, name, spy)
    return rows


def _count_lm_head_rows(engine, rows):
    def hook(module, args):
        rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    return engine.module.get_output_embeddings().register_forward_pre_hook(hook)


def _scored_rows(masks):
    return int(sum(float(m.sum()) for m in masks))


def _padded_window_rows(masks):
    """Rows the unfused padded path keeps: every row's last K columns, K from the leftmost masked column."""
    first = min(int(m.nonzero()[0]) for m in masks if m.any())
    return len(masks) * (max(len(m) for m in masks) - first)


@pytest.mark.parametrize("fused,rmpad,pad_mode", MODES)
@pytest.mark.parametrize("budget", [None, 12], ids=["one-micro", "micro-12"])
def test_infer_under_a_mask_equals_the_whole_head_there_and_zero_elsewhere(head_rows, fused, rmpad, pad_mode,
                                                                          budget):
    engine = _engine(fused, rmpad, pad_mode, budget)
    batch, masks = _batch(pad_mode)
    temperature = torch.linspace(0.7, 1.3, len(LENGTHS))
    hook = _count_lm_head_rows(engine, head_rows)
    whole = engine.infer_batch(batch, temperature=temperature)
    whole_rows = sum(head_rows)
    head_rows.clear()
    part = engine.infer_batch(batch, temperature=temperature, mask_field="response_mask")
    hook.remove()
    for key in ("log_probs", "entropy"):
        for got, want, mask in zip(per_sequence(part[key], batch, pad_mode), per_sequence(whole[key], batch, pad_mode),
                                   masks):
            torch.testing.assert_close(got, want * mask, rtol=1e-6, atol=1e-6, msg=key)
            assert torch.all(got[mask == 0] == 0), key
    if fused or rmpad:
        assert sum(head_rows) == _scored_rows(masks) < whole_rows, head_rows
    else:  # the padded rows' last columns, from the leftmost masked one (a 3-token row trains from column 0)
        assert sum(head_rows) <= whole_rows
        if budget is None:
            assert sum(head_rows) == _padded_window_rows(masks), head_rows


def test_infer_names_a_missing_mask_field():
    engine = _engine(True, True, "no_padding")
    batch, _ = _batch("no_padding")
    with pytest.raises(ValueError, match=r"infer_batch: batch has no mask_field 'loss_mask'"):
        engine.infer_batch(batch, mask_field="loss_mask")


def _step(engine, batch, loss_fn, temperature):
    sums = engine.forward_backward(batch, loss_fn, temperature)
    grads = {name: p.grad.detach().clone() for name, p in engine.module.named_parameters() if p.grad is not None}
    return sums, grads, engine.optimizer_step()


def _whole_head(loss_fn):
    """The same loss, opted out: the engine runs the whole head for it."""
    loss_fn.masked_positions_only = False
    assert not reads_masked_positions_only(loss_fn)
    return loss_fn


PPO_ALL_TERMS = dict(dual_clip_c=3.0, tis_cap=2.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.01)
LOSSES = [pytest.param(lambda: SFTLoss(agg_mode="seq-mean-token-mean"), id="sft"),
          pytest.param(lambda: PPOLoss(agg_mode="token-mean", **PPO_ALL_TERMS), id="ppo"),
          pytest.param(lambda: GSPOLoss(kl_coef=0.1, entropy_coef=0.01), id="gspo")]


@pytest.mark.parametrize("fused,rmpad,pad_mode", [m for m in MODES if m.values[2] == "no_padding"] +
                         [MODES[1], MODES[7]])
@pytest.mark.parametrize("make_loss", LOSSES)
def test_a_masked_only_loss_steps_as_with_the_whole_head(head_rows, fused, rmpad, pad_mode, make_loss):
    batch, masks = _batch(pad_mode)
    temperature = torch.linspace(0.7, 1.3, len(LENGTHS))
    narrow, whole = _engine(fused, rmpad, pad_mode, 12), _engine(fused, rmpad, pad_mode, 12)
    hooks = [_count_lm_head_rows(narrow, head_rows)]
    new = _step(narrow, batch, make_loss(), temperature)
    narrow_rows = sum(head_rows)
    head_rows.clear()
    hooks.append(_count_lm_head_rows(whole, head_rows))
    old = _step(whole, batch, _whole_head(make_loss()), temperature)
    for hook in hooks:
        hook.remove()
    assert 0 < narrow_rows < sum(head_rows), (narrow_rows, head_rows)
    assert sorted(new[0]) == sorted(old[0])
    for key in old[0]:
        torch.testing.assert_close(new[0][key], old[0][key], rtol=1e-5, atol=1e-7, msg=key)
    assert sorted(new[1]) == sorted(old[1]) and old[1]
    for name, grad in old[1].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(new[1][name], grad, rtol=1e-5, atol=1e-6 * max(scale, 1e-12), msg=name)
    assert new[2]["grad_norm"] == pytest.approx(old[2]["grad_norm"], rel=1e-5)


def test_the_declaration_is_read_on_the_losss_own_class():
    class Subclassed(SFTLoss):  # may read more than the mask: not trusted
        pass

    assert reads_masked_positions_only(SFTLoss()) and reads_masked_positions_only(PPOLoss())
    assert reads_masked_positions_only(GSPOLoss())
    assert not reads_masked_positions_only(Subclassed())
    assert not reads_masked_positions_only(_whole_head(SFTLoss()))


def test_a_micro_batch_without_masked_tokens_runs_and_adds_nothing(head_rows):
    """A sequence with an all-zero mask alone in its micro-batch: the head sees no row."""
    seqs = sequences([9, 7], seed=3)
    masks = [torch.zeros(9), torch.tensor([0, 0, 1, 1, 1, 1, 0.0])]
    batch = no_padding_batch(seqs, per_token={"response_mask": masks})
    narrow, whole = _engine(True, True, "no_padding", 9), _engine(True, True, "no_padding", 9)
    new = _step(narrow, batch, SFTLoss(), 1.0)
    assert 0 in head_rows and sum(head_rows) == 4
    old = _step(whole, batch, _whole_head(SFTLoss()), 1.0)
    torch.testing.assert_close(new[0]["loss"], old[0]["loss"], rtol=1e-6, atol=0)
    for name, grad in old[1].items():
        torch.testing.assert_close(new[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_mask_on_another_device_is_not_read():
    """The edge never reads a device mask back: such a pass keeps the whole head (checked with
    the meta device standing in for an accelerator)."""
    from polyfsdp.engines.head.rows import scored_mask

    assert scored_mask(torch.ones(3, device="meta")) is None
    assert scored_mask(torch.tensor([0.0, 1.0, 1.0])).tolist() == [False, True, True]
