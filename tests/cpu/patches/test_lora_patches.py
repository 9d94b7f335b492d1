"""Patches still apply under LoRA: patched base modules + adapters (the engine's order: patch,
then add adapters) give the logits of the unpatched model with the same adapters, on CPU
with the reference NPU ops standing in for torch_npu."""
import pytest

from tests.helpers.lora_reference import randomize_adapters
from polyfsdp.backends.npu import NPUBackend
from polyfsdp.engines.config import LoraConfig
from polyfsdp.patches import PatchToggles, apply_patches
from tests.npu import patch_harness as h
from tests.npu import reference_ops as ref

pytest.importorskip("peft", reason="LoRA tests need peft (pip install -e '.[lora]')")

from polyfsdp.engines.model.lora import add_adapters, adapters_disabled  # noqa: E402

LOGIT_TOL = 1e-5  # as tests/cpu/patches/test_patches_fused_ops.py
PATCH_KINDS = ("rms_norm", "rope", "swiglu", "attention")


@pytest.mark.parametrize("family", h.FAMILIES)
def test_patched_plus_lora_equals_unpatched_plus_lora(family):
    lora = LoraConfig(rank=4, alpha=8.0)
    unpatched = add_adapters(h.tiny_model(family), lora)
    randomize_adapters(unpatched, seed=2)
    seqs = h.sequences()
    want = h.per_sequence_logits(unpatched.eval(), seqs)
    with adapters_disabled(unpatched):
        base = h.per_sequence_logits(unpatched, seqs)
    assert h.max_error(base, want) > 100 * LOGIT_TOL  # the adapters matter

    with ref.installed_reference_torch_npu() as module:
        calls = []
        original = module.npu_fusion_attention

        def recording(*args, **kwargs):
            calls.append(args[4])
            return original(*args, **kwargs)

        module.npu_fusion_attention = recording
        patched = h.tiny_model(family)
        report = apply_patches(patched, NPUBackend(), PatchToggles(verify=True))
        assert report.applied == [f"{family}.{kind}" for kind in PATCH_KINDS], str(report)
        add_adapters(patched, lora)
        randomize_adapters(patched, seed=2)
        patched.eval()
        assert h.max_error(h.padded_logits(patched, seqs), want) <= LOGIT_TOL
        assert h.max_error(h.packed_logits(patched, seqs), want) <= LOGIT_TOL
        assert {"BSND", "TND"} <= set(calls)  # the fused attention ran, with the adapters around it
