"""The fused-op patches against the real torch_npu on an Ascend NPU (skipped elsewhere by conftest)."""
from __future__ import annotations

import pytest

from polyfsdp.backends import get_backend
from polyfsdp.patches import PatchToggles, apply_patches
from tests.npu import patch_harness as h

# fp32 on the device: fused kernels reorder reductions. Not yet measured on hardware; the CPU
# stand-in run measures ~1e-7, so anything near this bound deserves a look, not a wider bound.
LOGIT_TOL = 1e-4


@pytest.mark.parametrize("family", h.FAMILIES)
def test_npu_fused_patches_match_unpatched_logits_padded_and_packed(family):
    backend = get_backend("npu")
    # head_dim 32: inside every documented range of the fused ops.
    model = h.tiny_model(family, hidden_size=128).to(backend.device(0))
    seqs = h.sequences()
    want = h.per_sequence_logits(model, seqs)
    report = apply_patches(model, backend, PatchToggles(verify=True))
    assert report.applied == [f"{family}.{kind}" for kind in ("rms_norm", "rope", "swiglu", "attention")], str(report)
    assert h.max_error(h.padded_logits(model, seqs), want) <= LOGIT_TOL
    assert h.max_error(h.packed_logits(model, seqs), want) <= LOGIT_TOL
    assert h.max_error(h.packed_logits(model, seqs, with_cu_seqlens=True), want) <= LOGIT_TOL
    report.undo()
    assert h.max_error(h.padded_logits(model, seqs), want) <= LOGIT_TOL
