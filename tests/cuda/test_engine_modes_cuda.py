"""The infer_batch mode matrix on a GPU (skipped without one), bf16 and fp32 compute.

Reference: the unsharded fp32 HF model on the GPU, each sequence alone (eager attention), with
peaked outputs (engine_reference.sharpen_outputs). Tolerances: fp32 compute <= 1e-4 abs (GPU
GEMM/attention kernels reorder sums differently from the CPU ones; CPU measures <= 1.3e-6);
bf16 compute: engine_reference.BF16_TOLERANCE (3x the worst bf16 error measured on CPU, per
preset). Negative control per comparison: the output must NOT match a 0.9 x temperature reference.
"""
from dataclasses import replace

import pytest
import torch

from tests.helpers.engine_reference import (BF16_TOLERANCE, SHARP_LENGTHS, SHARP_TEMPS,  # noqa: E402
                              assert_matches_and_rejects_wrong_temperature, left_right_batch, no_padding_batch,
                              sequences, sharp_reference, sharpen_outputs)

from polyfsdp.backends import get_backend  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

MODES = [(rm, fu, pm) for rm in (True, False) for fu in (True, False) for pm in ("no_padding", "left_right")]
FP32_TOL = 1e-4


@pytest.mark.parametrize("preset", sorted(BF16_TOLERANCE))
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_gpu_infer_batch_matches_fp32_reference_in_every_mode(preset, param_dtype):
    engine = FSDPEngine(ModelConfig(preset=preset, seed=3), EngineConfig(param_dtype=param_dtype),
                        backend=get_backend("cuda")).initialize()
    sharpen_outputs(engine.module)
    seqs = sequences(SHARP_LENGTHS, seed=11)
    reference = sharp_reference(preset, engine.module, seqs, SHARP_TEMPS, device="cuda")
    for rmpad, fused, pad_mode in MODES:
        engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                       pad_mode=pad_mode)
        batch = (no_padding_batch if pad_mode == "no_padding" else left_right_batch)(seqs)
        out = engine.infer_batch(batch, temperature=torch.tensor(SHARP_TEMPS))
        for key in ("log_probs", "entropy"):
            value = out[key]
            assert value.device.type == "cuda"
            if pad_mode == "no_padding":
                assert torch.equal(value.offsets().cpu(), batch["input_ids"].offsets())
                got = value.values()
            else:
                assert value.shape == batch["input_ids"].shape
                got = value.cpu()[batch["attention_mask"].bool()]
            tol = FP32_TOL if param_dtype == "float32" else BF16_TOLERANCE[preset][key]
            assert_matches_and_rejects_wrong_temperature(got, reference, key, tol,
                                                         f"{preset} {param_dtype} {rmpad=} {fused=} {pad_mode}")
