"""NPU patches on vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), through the stand-in
torch_npu of tests/npu/reference_ops.py: the text decoder's norms and MLPs take the fused ops, the
vision tower is never edited (Qwen2.5-VL's tower uses the decoder's RMSNorm class), the rotary
and attention patches are skipped with their reason, and the engine's log-probs on rows with
images equal the unpatched model's."""
from __future__ import annotations

import pytest
import torch

from polyfsdp.backends.npu import NPUBackend
from polyfsdp.engines.parallel.fsdp import vision_tower
from polyfsdp.engines.presets import preset_config
from polyfsdp.patches import PatchToggles, apply_patches
from tests.helpers.vlm_reference import VLM_PRESETS, vlm_reference_logprobs, vlm_sequences
from tests.npu import reference_ops as ref

FAMILY = {"qwen2-vl-tiny": "qwen2_vl", "qwen2.5-vl-tiny": "qwen2_5_vl", "qwen3-vl-tiny": "qwen3_vl"}
TOL = 1e-5


def _model(preset: str):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(preset_config(preset), dtype=torch.float32).eval()


@pytest.mark.parametrize("preset", VLM_PRESETS)
def test_text_decoder_takes_the_fused_ops_and_the_tower_is_left_alone(preset):
    family = FAMILY[preset]
    model = _model(preset)
    seqs = vlm_sequences([["small"], ["wide", "square"], []], seed=3)
    with torch.no_grad():
        want, _ = vlm_reference_logprobs(model, seqs, [1.0] * len(seqs))
    tower_forwards = {name: vars(m).get("forward") for name, m in vision_tower(model).named_modules()}
    calls = []
    with ref.installed_reference_torch_npu() as module:
        for name in ("npu_rms_norm", "npu_swiglu"):
            op = getattr(module, name)
            setattr(module, name, lambda *a, _op=op, _name=name, **k: (calls.append(_name), _op(*a, **k))[1])
        report = apply_patches(model, NPUBackend(), PatchToggles(verify=True))
        assert report.applied == [f"{family}.rms_norm", f"{family}.swiglu"], str(report)
        assert set(report.skipped) == {f"{family}.rope", f"{family}.attention"}, str(report)
        assert "mrope" in report.skipped[f"{family}.rope"]
        assert "vision-language" in report.skipped[f"{family}.attention"]
        assert {name: vars(m).get("forward") for name, m in vision_tower(model).named_modules()} == tower_forwards
        calls.clear()
        with torch.no_grad():
            got, _ = vlm_reference_logprobs(model, seqs, [1.0] * len(seqs))
    assert {"npu_rms_norm", "npu_swiglu"} <= set(calls)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)
    report.undo()
    with torch.no_grad():
        again, _ = vlm_reference_logprobs(model, seqs, [1.0] * len(seqs))
    for a, w in zip(again, want):
        assert torch.equal(a, w)
