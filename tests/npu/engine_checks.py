"""FSDPEngine checks shared by the NPU suite (real torch_npu) and its CPU twin (the reference ops of
reference_ops.py behind the same patches): every mode against the independent plain-HF reference."""
from __future__ import annotations

from dataclasses import replace

import torch

from tests.helpers.engine_cases import LENGTHS, LR, PRESET, engine_config, masks_for, optim_config, reference_sft_step  # noqa: E402
from tests.helpers.engine_reference import (SHARP_LENGTHS, SHARP_TEMPS, assert_matches_and_rejects_wrong_temperature,  # noqa: E402
                              assert_params_close_after_adam_step, full_state_dict, left_right_batch,
                              no_padding_batch, sequences, sharp_reference, sharpen_outputs)

from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.engines.losses import SFTLoss  # noqa: E402

MODES = [(rm, fu, pm) for rm in (True, False) for fu in (True, False) for pm in ("no_padding", "left_right")]
PATCHES = ("rms_norm", "rope", "swiglu", "attention")


def _flat(value, batch, pad_mode):
    value = value.cpu() if pad_mode == "left_right" else value.values().cpu()
    return value[batch["attention_mask"].bool()] if pad_mode == "left_right" else value


def check_infer_every_mode(backend, preset, param_dtype, tols):
    """infer_batch in all 8 modes with every fused-op patch applied, against the fp32 reference on
    peaked outputs; ``tols`` maps log_probs/entropy to the bound. Returns the patch report."""
    engine = FSDPEngine(ModelConfig(preset=preset, seed=3), engine_config(param_dtype=param_dtype),
                        backend=backend).initialize()
    family = engine.module.config.model_type
    assert engine.patch_report.applied == [f"{family}.{p}" for p in PATCHES], str(engine.patch_report)
    sharpen_outputs(engine.module)
    seqs = sequences(SHARP_LENGTHS, seed=11)
    reference = sharp_reference(preset, engine.module, seqs, SHARP_TEMPS)
    for rmpad, fused, pad_mode in MODES:
        engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                       pad_mode=pad_mode)
        batch = (no_padding_batch if pad_mode == "no_padding" else left_right_batch)(seqs)
        out = engine.infer_batch(batch, temperature=torch.tensor(SHARP_TEMPS))
        for key in ("log_probs", "entropy"):
            assert out[key].device.type == backend.device_type
            assert_matches_and_rejects_wrong_temperature(_flat(out[key], batch, pad_mode), reference, key, tols[key],
                                                         f"{preset} {param_dtype} {rmpad=} {fused=} {pad_mode}")
    return engine.patch_report


def check_train_step(backend, rmpad, fused, pad_mode, loss_rel_tol, grad_tol):
    """One fp32 SFT train_batch step (backward through every patched op) against the plain-HF
    reference step: loss, gradient norm and every parameter (AdamW first-step bound)."""
    seqs = sequences(LENGTHS, seed=21)
    masks = masks_for(seqs)
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5),
                        engine_config(use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode),
                        optim_config(), backend=backend).initialize()
    assert len(engine.patch_report.applied) == len(PATCHES), str(engine.patch_report)
    initial = {k: v.cpu() for k, v in full_state_dict(engine.module).items()}
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    metrics = engine.train_batch(build(seqs, per_token={"response_mask": masks}), SFTLoss())
    after, grads, ref_loss, ref_norm = reference_sft_step(initial, seqs, masks)
    assert abs(metrics["loss"] - ref_loss) <= loss_rel_tol * abs(ref_loss), (metrics["loss"], ref_loss)
    assert abs(metrics["grad_norm"] - ref_norm) <= 10 * loss_rel_tol * ref_norm, (metrics["grad_norm"], ref_norm)
    params = {k: v.cpu() for k, v in full_state_dict(engine.module).items()}
    assert_params_close_after_adam_step(params, after, grads, LR, grad_tol)
