"""FSDPEngine.train_batch: split invariance, every mode vs a plain reference step, skips, errors."""
import math
from dataclasses import replace

import pytest
import torch

from tests.helpers.engine_cases import LENGTHS, LR, PRESET, engine_config, masks_for, optim_config, reference_sft_step
from tests.helpers.engine_reference import (assert_params_close_after_adam_step, full_state_dict, left_right_batch,
                              no_padding_batch, sequences)
from polyfsdp.engines.config import ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import PPOLoss, SFTLoss

# Parameters after one AdamW step are compared element-wise with the bound implied by a
# gradient error of GRAD_TOL (see engine_reference.adam_first_step_tolerance): AdamW's first
# update lr * g / (|g| + eps) turns fp32 noise in near-zero gradients (key biases have an
# analytically zero gradient) into O(lr) moves, while large gradients are held to ~1e-7.
GRAD_TOL = 1e-7


def _engine(**overrides):
    return FSDPEngine(ModelConfig(preset=PRESET, seed=5), engine_config(**overrides), optim_config()).initialize()


def _params(engine):
    return {k: v for k, v in full_state_dict(engine.module).items()}


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def data():
    seqs = sequences(LENGTHS, seed=21)
    return seqs, masks_for(seqs)


@pytest.fixture(scope="module")
def reference_step(data):
    """One SFT step of the plain HF model from the engines' initial weights."""
    seqs, masks = data
    initial = _params(_engine())
    after, grads, loss, norm = reference_sft_step(initial, seqs, masks)
    return initial, after, grads, loss, norm


MODES = [(rm, fu, pm) for rm in (True, False) for fu in (True, False) for pm in ("no_padding", "left_right")]


@pytest.mark.parametrize("rmpad,fused,pad_mode", MODES)
def test_every_mode_trains_one_step_to_the_reference_parameters(data, reference_step, rmpad, fused, pad_mode):
    seqs, masks = data
    initial, expected, grads, ref_loss, ref_norm = reference_step
    engine = _engine(use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode)
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    metrics = engine.train_batch(build(seqs, per_token={"response_mask": masks}), SFTLoss())
    assert metrics["step_skipped"] == 0
    assert math.isclose(metrics["loss"], ref_loss, rel_tol=1e-5)
    assert math.isclose(metrics["grad_norm"], ref_norm, rel_tol=1e-4)
    assert math.isclose(metrics["nll"], ref_loss, rel_tol=1e-5)
    assert metrics["lr"] == LR
    assert_params_close_after_adam_step(_params(engine), expected, grads, LR, GRAD_TOL)
    assert engine.global_step == 1


@pytest.mark.parametrize("impl", ["for_loop", "foreach", "fused"])
def test_every_adamw_kernel_trains_one_step_to_the_reference_parameters(data, reference_step, impl):
    seqs, masks = data
    initial, expected, grads, ref_loss, ref_norm = reference_step
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5), engine_config(),
                        replace(optim_config(), impl=impl)).initialize()
    metrics = engine.train_batch(no_padding_batch(seqs, per_token={"response_mask": masks}), SFTLoss())
    assert math.isclose(metrics["grad_norm"], ref_norm, rel_tol=1e-4)
    assert_params_close_after_adam_step(_params(engine), expected, grads, LR, GRAD_TOL)


def test_one_micro_batch_or_four_give_the_same_parameters(data, reference_step):
    seqs, masks = data
    grads = reference_step[2]
    batch = no_padding_batch(seqs, per_token={"response_mask": masks})
    whole = _engine()
    m_whole = whole.train_batch(batch, SFTLoss())
    split = _engine(max_tokens_per_micro_batch=12)
    from polyfsdp.engines.batch.micro import plan_micro_batches

    assert len(plan_micro_batches(LENGTHS, 12)) == 4
    m_split = split.train_batch(batch, SFTLoss())
    assert math.isclose(m_whole["loss"], m_split["loss"], rel_tol=1e-6)
    assert_params_close_after_adam_step(_params(split), _params(whole), grads, LR, GRAD_TOL)


def test_non_finite_gradient_norm_skips_the_step(data):
    seqs, masks = data
    engine = _engine()
    before = _params(engine)

    class NaNLoss(SFTLoss):
        def __call__(self, inputs):
            loss, metrics = super().__call__(inputs)
            return loss * float("nan"), metrics

    metrics = engine.train_batch(no_padding_batch(seqs, per_token={"response_mask": masks}), NaNLoss())
    assert metrics["step_skipped"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert _max_diff(_params(engine), before) == 0.0
    assert all(p.grad is None for p in engine.module.parameters())
    # The next, finite step trains normally.
    metrics = engine.train_batch(no_padding_batch(seqs, per_token={"response_mask": masks}), SFTLoss())
    assert metrics["step_skipped"] == 0 and _max_diff(_params(engine), before) > 0


def test_missing_required_fields_is_a_clear_error(data):
    seqs, masks = data
    engine = _engine()
    batch = no_padding_batch(seqs, per_token={"response_mask": masks})
    with pytest.raises(ValueError, match=r"missing \['old_log_probs', 'advantages'\]"):
        engine.train_batch(batch, PPOLoss())


def test_ppo_loss_receives_aligned_fields_in_left_right_mode(data):
    # old_log_probs = current log-probs and advantage 1 everywhere: ratio 1, loss = -1 exactly.
    seqs, masks = data
    engine = _engine(pad_mode="left_right", max_tokens_per_micro_batch=20)
    batch = left_right_batch(seqs, per_token={"response_mask": masks})
    batch["old_log_probs"] = engine.infer_batch(batch, calculate_entropy=False)["log_probs"]
    batch["advantages"] = torch.ones_like(batch["old_log_probs"])
    metrics = engine.train_batch(batch, PPOLoss(report_entropy=True))
    assert math.isclose(metrics["loss"], -1.0, rel_tol=1e-6)
    assert abs(metrics["approx_kl"]) < 1e-6 and metrics["clip_frac"] == 0.0


def test_gradient_checkpointing_trains_to_the_reference_parameters(data, reference_step):
    seqs, masks = data
    _, expected, grads, ref_loss, _ = reference_step
    engine = _engine(gradient_checkpointing=True, use_fused_kernels=True)
    metrics = engine.train_batch(no_padding_batch(seqs, per_token={"response_mask": masks}), SFTLoss())
    assert math.isclose(metrics["loss"], ref_loss, rel_tol=1e-5)
    assert_params_close_after_adam_step(_params(engine), expected, grads, LR, GRAD_TOL)


def test_sft_loss_with_its_own_mask_field_is_normalised_by_that_mask(data, reference_step):
    # The step's token count must come from the mask the loss reads, not from response_mask.
    seqs, masks = data
    _, _, _, ref_loss, _ = reference_step
    engine = _engine()
    metrics = engine.train_batch(no_padding_batch(seqs, per_token={"loss_mask": masks}),
                                 SFTLoss(mask_field="loss_mask"))
    assert math.isclose(metrics["loss"], ref_loss, rel_tol=1e-5)


def test_training_float16_master_weights_is_a_clear_error(data):
    # AdamW on float16 parameters: eps=1e-8 rounds to 0 in float16, so a zero gradient
    # gives 0/0 and the weights turn NaN after one "successful" step. Refuse it up front.
    seqs, masks = data
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5, dtype="float16"), engine_config(), optim_config()).initialize()
    before = _params(engine)
    with pytest.raises(ValueError, match=r"ModelConfig.dtype='float16'.*param_dtype='float16'"):
        engine.train_batch(no_padding_batch(seqs, per_token={"response_mask": masks}), SFTLoss())
    assert _max_diff(_params(engine), before) == 0.0


def test_training_bfloat16_master_weights_warns_once(data, caplog):
    # bf16 weights are fine for inference, but lr-sized AdamW updates mostly round away:
    # say so once instead of training silently slowly.
    seqs, masks = data
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5, dtype="bfloat16"), engine_config(), optim_config()).initialize()
    batch = no_padding_batch(seqs, per_token={"response_mask": masks})
    caplog.set_level("WARNING", logger="polyfsdp.engines.engine")
    engine.train_batch(batch, SFTLoss())
    engine.train_batch(batch, SFTLoss())
    warnings = [r for r in caplog.records if "master weights in bfloat16" in r.getMessage()]
    assert len(warnings) == 1 and "param_dtype='bfloat16'" in warnings[0].getMessage()
