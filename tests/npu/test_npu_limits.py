"""On an Ascend NPU (skipped elsewhere by conftest): the real ops at polyfsdp's documented limits
(backends/npu_limits.py) and through the call splits (backends/npu_op_splits.py), against the
plain-torch reference ops on the CPU; and the fused head's kernels through torchair's backend.
Tolerance fp32 1e-4, as test_patches_npu.py (not yet measured on hardware)."""
from __future__ import annotations

import pytest
import torch

from polyfsdp.backends import get_backend
from polyfsdp.engines.head import fused_compiled as flc
from tests.npu import reference_ops as ref

TOL = 1e-4


def _causal_mask(device):
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), 1)


def test_a_tnd_call_over_1024_sequences_is_split_and_matches_the_reference():
    backend = get_backend("npu")
    op = backend.fused_ops()["fusion_attention"]
    lengths = [1 + i % 3 for i in range(1030)]
    ends = torch.tensor(lengths).cumsum(0).tolist()
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(ends[-1], 4, 64, generator=gen), torch.randn(ends[-1], 2, 64, generator=gen)
    v = torch.randn(ends[-1], 2, 64, generator=gen)
    kwargs = dict(scale=0.125, sparse_mode=3, actual_seq_qlen=ends, actual_seq_kvlen=ends)
    device = backend.device(0)
    got = op(q.to(device), k.to(device), v.to(device), 4, "TND", atten_mask=_causal_mask(device), **kwargs)[0]
    want = torch.cat([ref.npu_fusion_attention(q[a:b], k[a:b], v[a:b], 4, "TND", atten_mask=_causal_mask("cpu"),
                                               scale=0.125, sparse_mode=3, actual_seq_qlen=[b - a],
                                               actual_seq_kvlen=[b - a])[0]
                      for a, b in zip([0] + ends[:-1], ends)])
    assert (got.cpu() - want).abs().max().item() <= TOL


def test_a_rotary_call_with_1500_rows_is_split_and_matches_the_reference():
    backend = get_backend("npu")
    op = backend.fused_ops()["rotary_mul"]
    x = torch.randn(1500, 2, 3, 64)
    angle = torch.rand(1500, 1, 3, 32)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    device = backend.device(0)
    got = op(x.to(device), cos.to(device), sin.to(device)).cpu()
    x1, x2 = x.chunk(2, -1)
    assert (got - (cos * x + sin * torch.cat((-x2, x1), -1))).abs().max().item() <= TOL


def test_fused_head_kernels_compile_through_torchair_or_say_why(monkeypatch):
    backend = get_backend("npu")
    reason = backend.compile_unsupported()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr(flc, "_compiler", "inductor")
    monkeypatch.setattr(flc, "_KERNELS", {})
    assert flc.resolve_fused_kernel_impl("compiled", backend) == ("compiled", True)
    kernels = flc.compiled_kernels(fallback_to_eager=False)  # a failing compile must show here
    y = torch.randn(6, 9, device=backend.device(0))
    labels = torch.randint(0, 9, (6,), device=y.device)
    for a, b in zip(kernels.forward_stats(y, labels, True), flc._forward_stats_entropy(y, labels)):
        assert (a - b).abs().max().item() <= TOL
