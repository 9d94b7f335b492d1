"""The infer_batch mode matrix on a GPU (skipped without one), bf16 and fp32 compute.

Reference: the unsharded fp32 HF model on the GPU, each sequence alone (eager attention).
Tolerances: fp32 compute <= 1e-4 abs (GPU GEMM/attention kernels reorder sums differently
from the CPU ones; 10x the CPU bound); bf16 compute <= 0.1 abs (8 mantissa bits; log-probs
and entropies of the tiny models are ~5 in magnitude).
"""
import os
import sys
from dataclasses import replace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cpu"))
from engine_reference import (full_state_dict, left_right_batch, no_padding_batch, reference_logprobs,  # noqa: E402
                              reference_model, sequences)

from polyfsdp.backends import get_backend  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

LENGTHS = [6, 1, 12, 6, 6, 3]
TEMPS = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 0.9])
MODES = [(rm, fu, pm) for rm in (True, False) for fu in (True, False) for pm in ("no_padding", "left_right")]
TOLS = {"float32": 1e-4, "bfloat16": 0.1}


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen2-tiny-tied", "llama-tiny"])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_gpu_infer_batch_matches_fp32_reference_in_every_mode(preset, param_dtype):
    engine = FSDPEngine(ModelConfig(preset=preset, seed=3), EngineConfig(param_dtype=param_dtype),
                        backend=get_backend("cuda")).initialize()
    reference = reference_model(preset, {k: v.cpu() for k, v in full_state_dict(engine.module).items()}).cuda()
    seqs = sequences(LENGTHS, seed=11)
    with torch.no_grad():
        exp_lp, exp_ent = reference_logprobs(reference, [s.cuda() for s in seqs], TEMPS.tolist())
    exp_lp, exp_ent = torch.cat(exp_lp).cpu(), torch.cat(exp_ent).cpu()
    for rmpad, fused, pad_mode in MODES:
        engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                       pad_mode=pad_mode)
        batch = (no_padding_batch if pad_mode == "no_padding" else left_right_batch)(seqs)
        out = engine.infer_batch(batch, temperature=TEMPS)
        for key, exp in (("log_probs", exp_lp), ("entropy", exp_ent)):
            value = out[key]
            assert value.device.type == "cuda"
            if pad_mode == "no_padding":
                assert torch.equal(value.offsets().cpu(), batch["input_ids"].offsets())
                got = value.values().cpu()
            else:
                assert value.shape == batch["input_ids"].shape
                got = value.cpu()[batch["attention_mask"].bool()]
            diff = (got.double() - exp).abs().max().item()
            assert diff <= TOLS[param_dtype], (key, rmpad, fused, pad_mode, diff)
