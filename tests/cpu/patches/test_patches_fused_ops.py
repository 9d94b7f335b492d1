"""Fused-op patches validated on CPU: torch_npu replaced by plain-torch reference ops written from
Ascend's documentation; every patch is applied through the real NPUBackend op table."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyfsdp.backends.npu import NPUBackend
from polyfsdp.patches import PatchToggles, apply_patches
from tests.npu import patch_harness as h
from tests.npu import reference_ops as ref

# fp32 logits of the patched model vs the unpatched per-sequence reference. Measured ~1e-7;
# the bound leaves room for reduction-order differences only.
LOGIT_TOL = 1e-5
PATCH_KINDS = ("rms_norm", "rope", "swiglu", "attention")


@pytest.fixture
def recorded_backend():
    """NPUBackend over the stand-in torch_npu, with every op call recorded as (op, layout)."""
    calls: list[tuple[str, str | None]] = []
    with ref.installed_reference_torch_npu() as module:
        for name in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention"):
            op = getattr(module, name)

            def recording(*args, _op=op, _name=name, **kwargs):
                layout = args[4] if _name == "npu_fusion_attention" else None
                calls.append((_name, layout))
                return _op(*args, **kwargs)

            setattr(module, name, recording)
        yield NPUBackend(), calls


@pytest.mark.parametrize("family", h.FAMILIES)
def test_all_fused_patches_match_unpatched_logits_padded_and_packed(family, recorded_backend):
    backend, calls = recorded_backend
    model = h.tiny_model(family)
    seqs = h.sequences()
    want = h.per_sequence_logits(model, seqs)
    report = apply_patches(model, backend, PatchToggles(verify=True))
    assert report.applied == [f"{family}.{kind}" for kind in PATCH_KINDS], str(report)

    calls.clear()
    padded = h.padded_logits(model, seqs)
    assert h.max_error(padded, want) <= LOGIT_TOL
    assert ("npu_fusion_attention", "BSND") in calls
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= {name for name, _ in calls}

    calls.clear()
    packed = h.packed_logits(model, seqs)
    assert h.max_error(packed, want) <= LOGIT_TOL
    assert ("npu_fusion_attention", "TND") in calls and ("npu_fusion_attention", "BSND") not in calls


def test_packed_with_flash_style_cu_seqlens_kwargs_matches_reference(recorded_backend):
    backend, calls = recorded_backend
    model = h.tiny_model("qwen2")
    seqs = h.sequences((3, 6, 1, 4))
    want = h.per_sequence_logits(model, seqs)
    apply_patches(model, backend)
    calls.clear()
    assert h.max_error(h.packed_logits(model, seqs, with_cu_seqlens=True), want) <= LOGIT_TOL
    assert ("npu_fusion_attention", "TND") in calls


def test_patched_generate_with_left_padding_and_cache_matches_unpatched(recorded_backend):
    backend, _ = recorded_backend
    model = h.tiny_model("llama")
    ids, mask = h.right_padded(h.sequences((5, 3)))
    ids, mask = ids.flip(1), mask.flip(1)  # left-padded prompts, as generate expects
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    before = model.generate(**kwargs)
    report = apply_patches(model, backend)
    assert len(report.applied) == 4
    # Token ids, exact: the patched ops' logits agree to float32 rounding, and greedy picks the same
    # tokens unless two logits tie to that rounding (none does on this model and these prompts).
    assert torch.equal(model.generate(**kwargs), before)


def test_undo_restores_bit_identical_logits(recorded_backend):
    backend, _ = recorded_backend
    model = h.tiny_model("qwen3")
    seqs = h.sequences()
    before_padded, before_packed = h.padded_logits(model, seqs), h.packed_logits(model, seqs)
    config_before = model.config
    report = apply_patches(model, backend)
    report.undo()
    assert report.applied == []
    assert model.config is config_before and model.config._attn_implementation == "sdpa"
    assert all(torch.equal(a, b) for a, b in zip(h.padded_logits(model, seqs), before_padded))
    assert all(torch.equal(a, b) for a, b in zip(h.packed_logits(model, seqs), before_packed))
    assert not any("forward" in vars(m) for m in model.modules())


def test_swiglu_patch_skips_a_non_silu_activation(recorded_backend):
    backend, _ = recorded_backend
    report = apply_patches(h.tiny_model("qwen2", hidden_act="gelu"), backend)
    assert "hidden_act is 'gelu'" in report.skipped["qwen2.swiglu"]
    assert "qwen2.rms_norm" in report.applied


def test_rope_patch_skips_scaled_rotary_outside_the_ops_value_range(recorded_backend):
    backend, _ = recorded_backend
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    report = apply_patches(h.tiny_model("llama", rope_parameters=rope), backend)
    assert "attention_scaling" in report.skipped["llama.rope"]


# ---------------------------------------------------------------- the reference ops themselves
def test_reference_rms_norm_matches_torch_rms_norm_and_returns_rstd():
    x, w = torch.randn(3, 5, 16), torch.randn(16)
    y, rstd = ref.npu_rms_norm(x, w, epsilon=1e-6)
    torch.testing.assert_close(y, F.rms_norm(x, (16,), w, eps=1e-6))
    assert rstd.shape == (3, 5, 1) and rstd.dtype == torch.float32
    with pytest.raises(ref.limits.OpLimitError, match="gamma dtype"):
        ref.npu_rms_norm(x, w.double())


def test_reference_rotary_mul_rotates_pairs_and_demands_4d():
    x = torch.randn(2, 3, 5, 8)
    angle = torch.rand(1, 1, 5, 4) * 3
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    out = ref.npu_rotary_mul(x, cos, sin)
    # Complex view: (x_i, x_{i+D/2}) is rotated by the angle.
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], -1))
    with pytest.raises(ValueError, match="4-D"):
        ref.npu_rotary_mul(x[0], cos[0], sin[0])
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        ref.npu_rotary_mul(x, cos * 2, sin)


def test_reference_rotary_mul_limits_b_times_n_when_cos_sin_need_gradients():
    # Ascend's documented half-mode limit: B*N <= 1024 when cos/sin need gradients (not otherwise).
    x = torch.randn(33, 32, 2, 8)  # BNSD, B*N = 1056
    cos = torch.full((1, 1, 2, 8), 0.5, requires_grad=True)
    sin = torch.full((1, 1, 2, 8), 0.5)
    with pytest.raises(ValueError, match="B\\*N .* <= 1024, got 1056"):
        ref.npu_rotary_mul(x, cos, sin)
    ref.npu_rotary_mul(x, cos.detach(), sin)
    with torch.no_grad():
        ref.npu_rotary_mul(x, cos, sin)
    ref.npu_rotary_mul(x[:32], cos, sin)  # B*N = 1024


def test_reference_swiglu_rejects_non_contiguous_input():
    x = torch.randn(4, 6)
    torch.testing.assert_close(ref.npu_swiglu(x), F.silu(x[:, :3]) * x[:, 3:])
    with pytest.raises(ValueError, match="contiguous"):
        ref.npu_swiglu(x.t())
    with pytest.raises(ValueError, match="even"):
        ref.npu_swiglu(torch.randn(4, 5))


def test_reference_fusion_attention_tnd_matches_per_sequence_causal_sdpa_with_gqa():
    lengths = [3, 5, 2]
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    out = ref.npu_fusion_attention(q, k, v, 4, "TND", atten_mask=mask, scale=0.3, sparse_mode=3,
                                   actual_seq_qlen=[3, 8, 10], actual_seq_kvlen=[3, 8, 10])
    assert isinstance(out, tuple) and len(out) == 7
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        want = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                              is_causal=True, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[0][sl], want.transpose(0, 1))
        start += n


def test_reference_fusion_attention_bsnd_mask_true_means_masked():
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 4, 8), torch.randn(2, 5, 4, 8)
    masked = torch.rand(2, 1, 5, 5) > 0.6
    masked[..., 0] = False  # every query keeps at least one key
    out = ref.npu_fusion_attention(q, k, v, 4, "BSND", atten_mask=masked, scale=0.5)[0]
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=~masked, scale=0.5)
    torch.testing.assert_close(out, want.transpose(1, 2))


@pytest.mark.parametrize("qlen, error, match", [
    ([3, 2, 10], ValueError, "cumulative"),
    ([3, 8, 9], ValueError, "end at T=10"),
    (torch.tensor([3, 8, 10]), ValueError, "host list"),
    (None, ValueError, "needs actual_seq_qlen"),
])
def test_reference_fusion_attention_rejects_bad_actual_seq_qlen(qlen, error, match):
    q = torch.randn(10, 2, 8)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    with pytest.raises(error, match=match):
        ref.npu_fusion_attention(q, q, q, 2, "TND", atten_mask=mask, sparse_mode=3, actual_seq_qlen=qlen,
                                 actual_seq_kvlen=[3, 8, 10])


def test_reference_fusion_attention_rejects_unknown_layout_and_wrong_causal_mask():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="input_layout"):
        ref.npu_fusion_attention(q, q, q, 2, "BHSD")
    with pytest.raises(ValueError, match="2048"):
        ref.npu_fusion_attention(q, q, q, 2, "BSND", atten_mask=torch.ones(4, 4, dtype=torch.bool), sparse_mode=3)


def test_patched_gradients_match_unpatched_for_packed_training_step(recorded_backend):
    backend, _ = recorded_backend
    model = h.tiny_model("qwen3")
    ids, positions, _ = h.packed(h.sequences())

    def grads():
        model.zero_grad()
        model(input_ids=ids, position_ids=positions, use_cache=False).logits.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = grads()
    apply_patches(model, backend)
    got = grads()
    assert max((got[n] - want[n]).abs().max().item() for n in want) <= LOGIT_TOL
