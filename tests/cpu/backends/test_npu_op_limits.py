"""The documented limits of the NPU ops (backends/npu_limits.py), checked before a patch applies:
a model outside one keeps the plain op and the report names the limit; a model at the limit
gets the fused op. The reference ops enforce the same table, so a patch that skipped the check
would fail on the CPU (the negative control below)."""
from __future__ import annotations

import pytest
import torch

from polyfsdp.backends import npu_limits
from polyfsdp.backends.npu import NPUBackend
from polyfsdp.patches import apply_patches
from tests.npu import patch_harness as h
from tests.npu import reference_ops as ref


@pytest.fixture
def npu_backend():
    with ref.installed_reference_torch_npu():
        yield NPUBackend()


# (family, config overrides, patch that must be skipped, words of its reason, patch that still applies)
OUTSIDE = [
    ("qwen3", dict(head_dim=776), "attention", "head_dim 776 outside 1..768", "rope"),
    ("qwen3", dict(num_attention_heads=264, num_key_value_heads=8, head_dim=2), "attention",
     "num_attention_heads 264 outside 1..256", "rope"),
    ("qwen2", dict(num_attention_heads=4, num_key_value_heads=3), "attention",
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3", "rms_norm"),
    ("qwen3", dict(head_dim=900), "rope", "head_dim 900 must be even and below 896", "swiglu"),
    ("qwen3", dict(num_attention_heads=1000, num_key_value_heads=8, head_dim=2), "rope",
     "head count 1000 must be below 1000", "rms_norm"),
]
# The same limits, just inside: the patch applies.
INSIDE = [
    ("qwen3", dict(head_dim=768), "attention"),
    ("qwen3", dict(num_attention_heads=256, num_key_value_heads=8, head_dim=2), "attention"),
    ("qwen3", dict(head_dim=894), "rope"),
    ("qwen3", dict(num_attention_heads=998, num_key_value_heads=2, head_dim=2), "rope"),
]


@pytest.mark.parametrize("family,overrides,skipped,words,applied", OUTSIDE)
def test_a_model_outside_a_documented_limit_keeps_the_plain_op_and_the_report_names_it(
        npu_backend, family, overrides, skipped, words, applied):
    model = h.tiny_model(family, **overrides)
    report = apply_patches(model, npu_backend)
    reason = report.skipped[f"{family}.{skipped}"]
    assert words in reason and npu_limits.SOURCES[npu_limits.OP_NAMES[
        {"attention": "fusion_attention", "rope": "rotary_mul"}[skipped]]] in reason, reason
    assert f"{family}.{applied}" in report.applied, str(report)
    assert skipped in str(report) and words in str(report)


@pytest.mark.parametrize("family,overrides,patch", INSIDE)
def test_a_model_at_the_documented_limit_gets_the_fused_op(npu_backend, family, overrides, patch):
    report = apply_patches(h.tiny_model(family, **overrides), npu_backend)
    assert f"{family}.{patch}" in report.applied, str(report)


def test_an_undocumented_compute_dtype_keeps_every_plain_op(npu_backend):
    model = h.tiny_model("llama").double()
    report = apply_patches(model, npu_backend)
    assert report.applied == []
    assert all("compute dtype float64 is not float16, bfloat16 or float32" in r for r in report.skipped.values())
    # The dtype judged is the one FSDP computes in, when the caller says so.
    report = apply_patches(h.tiny_model("llama"), npu_backend, compute_dtype=torch.float64)
    assert report.applied == [] and len(report.skipped) == 4


def test_without_the_check_the_reference_ops_catch_the_out_of_limit_call(npu_backend, monkeypatch):
    # Negative control: with the pre-patch check switched off, the attention patch applies to a
    # head_dim-776 model, and its first forward fails in the reference op on the same limit.
    monkeypatch.setattr(npu_limits, "model_problem", lambda op, facts: None)
    model = h.tiny_model("qwen3", head_dim=776)
    report = apply_patches(model, npu_backend)
    assert "qwen3.attention" in report.applied
    with pytest.raises(npu_limits.OpLimitError, match="head dim 776 outside 1..768"):
        h.packed_logits(model, h.sequences())


def _tnd(total: int, heads: int = 2, head_dim: int = 8):
    q = torch.randn(total, heads, head_dim)
    return q, torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)


def test_reference_fusion_attention_enforces_the_tnd_limits():
    q, mask = _tnd(1025)
    ends = list(range(1, 1026))
    with pytest.raises(npu_limits.OpLimitError, match="1025 sequences; TND takes at most 1024"):
        ref.npu_fusion_attention(q, q, q, 2, "TND", atten_mask=mask, sparse_mode=3,
                                 actual_seq_qlen=ends, actual_seq_kvlen=ends)
    ref.npu_fusion_attention(q[:1024], q[:1024], q[:1024], 2, "TND", atten_mask=mask, sparse_mode=3,
                             actual_seq_qlen=ends[:1024], actual_seq_kvlen=ends[:1024])
    wide = torch.randn(4, 2, 776)
    with pytest.raises(npu_limits.OpLimitError, match="head dim 776"):
        ref.npu_fusion_attention(wide, wide, wide, 2, "TND", atten_mask=mask, sparse_mode=3,
                                 actual_seq_qlen=[4], actual_seq_kvlen=[4])
    with pytest.raises(npu_limits.OpLimitError, match="query heads 4 must be a multiple of key/value heads 3"):
        ref.npu_fusion_attention(torch.randn(4, 4, 8), torch.randn(4, 3, 8), torch.randn(4, 3, 8), 4, "TND",
                                 atten_mask=mask, sparse_mode=3, actual_seq_qlen=[4], actual_seq_kvlen=[4])


def test_reference_rotary_mul_enforces_the_batch_and_head_limits():
    cos = torch.full((1, 1, 3, 8), 0.5)
    ref.npu_rotary_mul(torch.randn(2, 999, 3, 8), cos, cos)
    with pytest.raises(npu_limits.OpLimitError, match="B 2 and N 1000 must be below 1000"):
        ref.npu_rotary_mul(torch.randn(2, 1000, 3, 8), cos, cos)
    with pytest.raises(npu_limits.OpLimitError, match="D 896 must be even and below 896"):
        ref.npu_rotary_mul(torch.randn(1, 1, 3, 896), torch.zeros(1, 1, 3, 896), torch.zeros(1, 1, 3, 896))


def test_reference_swiglu_and_rms_norm_enforce_their_limits():
    with pytest.raises(npu_limits.OpLimitError, match="must not be empty"):
        ref.npu_swiglu(torch.randn(0, 4))
    with pytest.raises(npu_limits.OpLimitError, match="self has 1 dims, not 2..8"):
        ref.npu_rms_norm(torch.randn(16), torch.randn(16))
