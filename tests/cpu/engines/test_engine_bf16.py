"""bf16 compute (FSDP2 MixedPrecisionPolicy param_dtype=bfloat16) matches the fp32 reference in
every remove-padding x fused mode on CPU, within tolerances derived from measured bf16 error
(engine_reference.BF16_TOLERANCE: 3x the worst measured), on models with peaked outputs
(engine_reference.sharpen_outputs). Each comparison carries its negative control: the same output
is NOT within tolerance of a 0.9 x temperature reference, and no constant entropy would pass."""
from dataclasses import replace

import pytest
import torch

from tests.helpers.engine_reference import (BF16_TOLERANCE, SHARP_LENGTHS, SHARP_TEMPS, assert_matches_and_rejects_wrong_temperature,
                              no_padding_batch, sequences, sharp_reference, sharpen_outputs)
from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine


@pytest.mark.parametrize("preset", sorted(BF16_TOLERANCE))
def test_bf16_param_dtype_is_close_to_fp32_reference_in_every_remove_padding_fused_mode(preset):
    engine = FSDPEngine(ModelConfig(preset=preset, seed=3),
                        EngineConfig(param_dtype="bfloat16", reduce_dtype="float32")).initialize()
    sharpen_outputs(engine.module)
    seqs = sequences(SHARP_LENGTHS, seed=11)
    reference = sharp_reference(preset, engine.module, seqs, SHARP_TEMPS)
    for rmpad in (True, False):
        for fused in (True, False):
            engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused)
            out = engine.infer_batch(no_padding_batch(seqs), temperature=torch.tensor(SHARP_TEMPS))
            assert out["log_probs"].dtype == torch.float32
            for key in ("log_probs", "entropy"):
                assert_matches_and_rejects_wrong_temperature(out[key].values(), reference, key,
                                                             BF16_TOLERANCE[preset][key], f"{preset} {rmpad=} {fused=}")


def test_bf16_temperature_control_catches_an_ignored_temperature():
    # The negative control itself: feeding T=1 everywhere instead of SHARP_TEMPS must fail the check.
    preset = "qwen2-tiny"
    engine = FSDPEngine(ModelConfig(preset=preset, seed=3), EngineConfig(param_dtype="bfloat16")).initialize()
    sharpen_outputs(engine.module)
    seqs = sequences(SHARP_LENGTHS, seed=11)
    reference = sharp_reference(preset, engine.module, seqs, SHARP_TEMPS)
    out = engine.infer_batch(no_padding_batch(seqs))
    for key in ("log_probs", "entropy"):
        with pytest.raises(AssertionError, match="max \\|diff\\|"):
            assert_matches_and_rejects_wrong_temperature(out[key].values(), reference, key, BF16_TOLERANCE[preset][key])
