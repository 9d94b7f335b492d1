"""bf16 compute (FSDP2 MixedPrecisionPolicy param_dtype=bfloat16) runs in every mode on CPU.

Tolerance: bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%); on this 2-layer model
log-probs (~-5) and entropies (~5) stay within 0.1 absolute of the fp32 reference.
"""
from dataclasses import replace

import torch

from engine_reference import full_state_dict, no_padding_batch, reference_logprobs, reference_model, sequences
from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine

BF16_TOL = 0.1


def test_bf16_param_dtype_is_close_to_fp32_reference_in_every_remove_padding_fused_mode():
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=2),
                        EngineConfig(param_dtype="bfloat16", reduce_dtype="float32")).initialize()
    reference = reference_model("qwen2-tiny", full_state_dict(engine.module))
    seqs = sequences([5, 1, 9, 5], seed=6)
    with torch.no_grad():
        exp_lp, exp_ent = reference_logprobs(reference, seqs, [1.0] * 4)
    for rmpad in (True, False):
        for fused in (True, False):
            engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused)
            out = engine.infer_batch(no_padding_batch(seqs))
            assert out["log_probs"].dtype == torch.float32
            assert (out["log_probs"].values().double() - torch.cat(exp_lp)).abs().max() <= BF16_TOL
            assert (out["entropy"].values().double() - torch.cat(exp_ent)).abs().max() <= BF16_TOL
