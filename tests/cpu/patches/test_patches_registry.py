"""Patch registry contract: isolation, toggles from Hydra overrides, verification rollback, pass-through
for unpatched model types, per-instance effects, lazy imports."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from polyfsdp.backends.base import Backend
from polyfsdp.backends.cpu import CPUBackend
from polyfsdp.patches import (
    Patch,
    PatchToggles,
    apply_patches,
    known_patch_names,
    register,
    unregister,
    validate_toggles,
)
from polyfsdp.patches.verify import ProbeCase
from tests.npu import patch_harness as h
from tests.npu import reference_ops as ref

LOGIT_TOL = 1e-5  # fp32; measured ~1e-7 (see test_patches_fused_ops)
QWEN2_PATCHES = ["qwen2.rms_norm", "qwen2.rope", "qwen2.swiglu", "qwen2.attention"]


class ReferenceOpsBackend(Backend):
    """A CPU backend whose fused-op table holds the plain-torch reference ops."""

    name = "reference"
    device_type = "cpu"
    dist_backend = "gloo"

    def availability(self):
        return None

    def fused_ops(self):
        return {"rms_norm": ref.npu_rms_norm, "rotary_mul": ref.npu_rotary_mul, "swiglu": ref.npu_swiglu,
                "fusion_attention": ref.npu_fusion_attention}


@pytest.fixture
def temporary_patch():
    """Register test patches for one test only."""
    names = []

    def add(patch: Patch) -> Patch:
        names.append(register(patch).name)
        return patch

    yield add
    for name in names:
        unregister(name)


def _norm_probe(model):
    norm = model.model.norm
    x = torch.randn(2, 3, norm.weight.shape[0], generator=torch.Generator().manual_seed(0))
    return [ProbeCase("final norm", norm, lambda: ((x,), {}))]


def _outputs(model, seqs):
    return h.padded_logits(model, seqs) + h.packed_logits(model, seqs)


def _identical(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_failing_patch_is_rolled_back_alone_and_undo_is_bit_exact(temporary_patch):
    def half_then_raise(model, ops, edits):
        edits.set_attr(model.model.norm, "variance_epsilon", 123.0)  # a partial change that must not survive
        edits.replace_forward(model.model.layers[0].mlp, lambda self, x: x * 0)
        raise RuntimeError("simulated transformers API change")

    temporary_patch(Patch("qwen2.broken", ("qwen2",), ("rms_norm",), half_then_raise))
    model = h.tiny_model("qwen2")
    seqs = h.sequences()
    want = h.per_sequence_logits(model, seqs)
    before = _outputs(model, seqs)

    report = apply_patches(model, ReferenceOpsBackend())
    assert report.applied == QWEN2_PATCHES
    assert "simulated transformers API change" in report.failed["qwen2.broken"]
    assert "qwen2.broken" in str(report) and "failed" in str(report)
    assert model.model.norm.variance_epsilon == model.config.rms_norm_eps
    # The broken patch's swap of this forward is undone; the swiglu patch's swap stays.
    assert vars(model.model.layers[0].mlp)["forward"].__func__.__name__ == "_swiglu_mlp_forward"
    assert h.max_error(h.padded_logits(model, seqs), want) <= LOGIT_TOL
    assert h.max_error(h.packed_logits(model, seqs), want) <= LOGIT_TOL

    report.undo()
    assert _identical(_outputs(model, seqs), before)


def test_exception_in_patch_leaves_no_edit_behind(temporary_patch):
    def edit_then_raise(model, ops, edits):
        edits.replace_forward(model.model.layers[0].mlp, lambda self, x: x * 0)
        edits.set_attr(model.model.norm, "variance_epsilon", 123.0)
        raise KeyError("boom")

    temporary_patch(Patch("qwen2.broken", ("qwen2",), (), edit_then_raise))
    model = h.tiny_model("qwen2")
    before = _outputs(model, h.sequences())
    report = apply_patches(model, CPUBackend())
    assert "KeyError" in report.failed["qwen2.broken"] and "undone" in report.failed["qwen2.broken"]
    assert "forward" not in vars(model.model.layers[0].mlp)
    assert _identical(_outputs(model, h.sequences()), before)


def _toggles_from_overrides(*overrides: str) -> PatchToggles:
    """Parse Hydra override strings the way the trainer's command line does, into the patches group."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    config = OmegaConf.create({"patches": {"enabled": True, "disable_families": [], "disable": [], "verify": False}})
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        OmegaConf.update(config, override.key_or_group, override.value(), merge=False)
    return PatchToggles.from_config(config.patches)


def test_hydra_override_disables_one_patch_by_name():
    toggles = _toggles_from_overrides("patches.disable=[qwen2.rope]", "patches.verify=true")
    assert toggles.disable == ("qwen2.rope",) and toggles.verify
    report = apply_patches(h.tiny_model("qwen2"), ReferenceOpsBackend(), toggles)
    assert report.skipped == {"qwen2.rope": "off (patches.disable)"}
    assert report.applied == ["qwen2.rms_norm", "qwen2.swiglu", "qwen2.attention"]


def test_hydra_overrides_disable_a_family_or_everything():
    model = h.tiny_model("qwen2")
    report = apply_patches(model, ReferenceOpsBackend(), _toggles_from_overrides("patches.disable_families=[qwen2]"))
    assert report.applied == [] and set(report.skipped) == set(QWEN2_PATCHES)
    report = apply_patches(model, ReferenceOpsBackend(), _toggles_from_overrides("patches.enabled=false"))
    assert report.applied == [] and all("patches.enabled" in r for r in report.skipped.values())


def test_toggles_reject_unknown_names_keys_and_types():
    with pytest.raises(ValueError, match="unknown patch 'qwen2.ropee'.*qwen2.rope"):
        validate_toggles(PatchToggles(disable=["qwen2.ropee"]))
    with pytest.raises(ValueError, match="unknown family 'qwen9'.*qwen2"):
        validate_toggles(PatchToggles(disable_families=["qwen9"]))
    with pytest.raises(ValueError, match="unknown patch 'qwen2.ropee'"):
        apply_patches(h.tiny_model("qwen2"), ReferenceOpsBackend(), {"disable": ["qwen2.ropee"]})
    with pytest.raises(ValueError, match="unknown key.*disabled.*allowed keys"):
        PatchToggles.from_config({"disabled": ["qwen2.rope"]})
    with pytest.raises(TypeError, match="list of names"):
        PatchToggles(disable="qwen2.rope")
    with pytest.raises(TypeError, match="patches.verify"):
        PatchToggles(verify="yes")
    assert "qwen3.attention" in known_patch_names()


def test_verification_rolls_back_a_numerically_wrong_patch(temporary_patch):
    def wrong_norm(model, ops, edits):
        norm = model.model.norm
        original = type(norm).forward
        edits.replace_forward(norm, lambda self, x: original(self, x) * 1.1)

    temporary_patch(Patch("qwen2.wrong_norm", ("qwen2",), ("rms_norm",), wrong_norm, probe=_norm_probe))
    only_wrong = {"disable": QWEN2_PATCHES}
    model = h.tiny_model("qwen2")
    seqs = h.sequences()
    before = _outputs(model, seqs)

    report = apply_patches(model, ReferenceOpsBackend(), {**only_wrong, "verify": True})
    assert "max abs error" in report.failed["qwen2.wrong_norm"] and "rolled back" in report.failed["qwen2.wrong_norm"]
    assert _identical(_outputs(model, seqs), before)

    unverified = apply_patches(model, ReferenceOpsBackend(), {**only_wrong, "verify": False})
    assert unverified.applied == ["qwen2.wrong_norm"]  # without verification the wrong patch stays
    assert not _identical(_outputs(model, seqs), before)
    unverified.undo()


def test_model_type_without_patches_passes_untouched_and_is_reported():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = apply_patches(model, ReferenceOpsBackend(), PatchToggles(verify=True))
    assert report.applied == [] and report.skipped == {} and report.failed == {}
    assert "no patches registered for model type 'gpt2'" in str(report)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_cpu_backend_skips_every_patch_and_leaves_model_untouched():
    model = h.tiny_model("llama")
    before = _outputs(model, h.sequences())
    report = apply_patches(model, CPUBackend())
    assert report.applied == []
    assert report.skipped["llama.rms_norm"] == "backend offers no rms_norm (cpu)"
    assert report.skipped["llama.attention"] == "backend offers no fusion_attention (cpu)"
    assert not any("forward" in vars(m) for m in model.modules())
    assert _identical(_outputs(model, h.sequences()), before)


def test_two_models_sharing_one_config_do_not_affect_each_other():
    config = h.tiny_config("qwen2")
    patched, plain = h.tiny_model("qwen2", seed=0, config=config), h.tiny_model("qwen2", seed=1, config=config)
    seqs = h.sequences()
    plain_before, patched_want = _outputs(plain, seqs), h.per_sequence_logits(patched, seqs)
    report = apply_patches(patched, ReferenceOpsBackend())
    assert len(report.applied) == 4
    assert plain.config._attn_implementation == "sdpa" and plain.config is config
    assert not any("forward" in vars(m) for m in plain.modules())
    assert _identical(_outputs(plain, seqs), plain_before)
    assert h.max_error(h.packed_logits(patched, seqs), patched_want) <= LOGIT_TOL


def test_applying_twice_without_undo_is_an_error():
    model = h.tiny_model("qwen2")
    report = apply_patches(model, ReferenceOpsBackend())
    with pytest.raises(ValueError, match="already applied"):
        apply_patches(model, ReferenceOpsBackend())
    report.undo()
    apply_patches(model, ReferenceOpsBackend()).undo()


def test_importing_patches_imports_no_transformers_model_code():
    code = (
        "import sys, polyfsdp.patches as p\n"
        "p.validate_toggles(p.PatchToggles(disable=['qwen2.rope'], disable_families=['llama']))\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_undo_restores_replaced_parameters_and_buffers():
    # Parameters and buffers live in _parameters/_buffers, not the instance __dict__: undo must put
    # the originals back, not delete the attribute.
    from polyfsdp.patches import EditLog

    linear = torch.nn.Linear(3, 2)
    linear.register_buffer("scale", torch.ones(2))
    weight, scale = linear.weight, linear.scale
    before = dict(linear.state_dict())
    edits = EditLog()
    edits.set_attr(linear, "weight", torch.nn.Parameter(torch.zeros(2, 3)))
    edits.set_attr(linear, "scale", torch.zeros(2))
    assert not linear.weight.detach().any()
    edits.undo()
    assert linear.weight is weight and linear.scale is scale
    assert [n for n, _ in linear.named_parameters()] == ["weight", "bias"]
    assert all(torch.equal(before[k], v) for k, v in linear.state_dict().items()) and set(before) == set(linear.state_dict())
