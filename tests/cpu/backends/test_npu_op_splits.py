"""Batch-dependent op limits the config check cannot rule out: the NPU backend's op table splits a
TND call with more than 1024 sequences (or 1M tokens) and a rotary call with 1000+ rows into calls
inside the limits (backends/npu_op_splits.py), with the same numbers. The reference ops refuse the
unsplit calls (negative controls)."""
from __future__ import annotations

import pytest
import torch

from polyfsdp.backends import npu_op_splits as splits
from polyfsdp.backends.npu import NPUBackend
from polyfsdp.backends.npu_limits import OpLimitError
from polyfsdp.patches import apply_patches
from tests.npu import patch_harness as h
from tests.npu import reference_ops as ref


def test_a_packed_batch_of_more_than_1024_sequences_runs_as_several_tnd_calls():
    lengths = [1 + i % 2 for i in range(1030)]
    seqs = h.sequences(lengths, seed=3)
    model = h.tiny_model("qwen2")
    want = h.packed_logits(model, seqs, with_cu_seqlens=True)
    calls = []
    with ref.installed_reference_torch_npu() as module:
        raw = module.npu_fusion_attention

        def counted(*args, **kwargs):
            calls.append(len(kwargs.get("actual_seq_qlen") or []))
            return raw(*args, **kwargs)

        module.npu_fusion_attention = counted
        report = apply_patches(model, NPUBackend())
        assert "qwen2.attention" in report.applied
        got = h.packed_logits(model, seqs, with_cu_seqlens=True)
    assert h.max_error(got, want) <= 1e-5
    assert calls and set(calls) == {1024, 6}  # each layer: 1024 sequences, then the other 6
    q = torch.randn(sum(lengths), 4, 8)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    with pytest.raises(OpLimitError, match="1030 sequences"):
        raw(q, q[:, :2], q[:, :2], 4, "TND", atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1),
            sparse_mode=3, actual_seq_qlen=ends, actual_seq_kvlen=ends)


def test_groups_respect_the_sequence_and_token_limits(monkeypatch):
    ends = list(range(1, 2051))
    assert [(a, b) for a, b, _, _ in splits._tnd_groups(ends, ends)] == [(0, 1024), (1024, 2048), (2048, 2050)]
    monkeypatch.setattr(splits, "FA_TOKENS", (1, 10))
    ends = [4, 8, 12, 13, 30]  # lengths 4, 4, 4, 1, 17: a sequence longer than the limit stays whole
    assert splits._tnd_groups(ends, ends) == [(0, 2, 0, 0), (2, 4, 8, 8), (4, 5, 13, 13)]


@pytest.mark.parametrize("per_row", [True, False])
def test_a_rotary_call_with_1000_or_more_rows_runs_in_parts(per_row):
    x = torch.randn(1500, 2, 3, 8)
    angle = torch.rand(1500 if per_row else 1, 1, 3, 4)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    with pytest.raises(OpLimitError, match="B 1500 and N 2 must be below 1000"):
        ref.npu_rotary_mul(x, cos, sin)
    out = splits.split_rotary_mul(ref.npu_rotary_mul)(x, cos, sin)
    x1, x2 = x.chunk(2, -1)
    torch.testing.assert_close(out, cos * x + sin * torch.cat((-x2, x1), -1))
