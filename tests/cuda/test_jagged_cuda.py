"""The jagged conversions run on a GPU without a single host-device synchronisation."""
from __future__ import annotations

import pytest
import torch

from polyfsdp.engines import jagged as J

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _SyncForbidden:
    """Any synchronising CUDA call inside the block raises (torch's sync debug mode)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def _batch(dtype=torch.float32, rest=(3,)):
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 0, 8, 1, 8], dtype=torch.int64)
    dense = torch.randn(5, 8, *rest, generator=gen).to(dtype)
    return dense, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_dense_to_jagged_host_lengths_never_syncs_and_matches_cpu(dtype):
    dense, lens = _batch(dtype)
    expected = J.dense_to_jagged(dense, lens)
    dense_gpu = dense.cuda()
    torch.cuda.synchronize()
    with _SyncForbidden():
        nt = J.dense_to_jagged(dense_gpu, lens)
        back = J.jagged_to_dense(nt, padding_value=0, length=8)
    assert torch.equal(nt.values().cpu(), expected.values())
    assert torch.equal(J.offsets(nt).cpu(), J.offsets(expected))
    assert torch.equal(back.cpu(), J.jagged_to_dense(expected, padding_value=0, length=8))


def test_dense_to_jagged_device_lengths_with_total_never_syncs():
    dense, lens = _batch()
    expected_values, expected_offsets = J.dense_to_flat(dense, lens)
    dense_gpu, lens_gpu = dense.cuda(), lens.cuda()
    torch.cuda.synchronize()
    with _SyncForbidden():
        nt = J.dense_to_jagged(dense_gpu, lens_gpu, total=int(lens.sum()))
        values, offs = J.dense_to_flat(dense_gpu, lens_gpu, total=int(lens.sum()))
        padded = J.flat_to_dense(values, offs, 8, padding_value=-1.0, side="left")
        labels = J.next_token_labels_flat(values, offs)
    assert torch.equal(nt.values().cpu(), expected_values)
    assert torch.equal(values.cpu(), expected_values)
    assert torch.equal(offs.cpu(), expected_offsets)
    assert torch.equal(padded.cpu(), J.flat_to_dense(expected_values, expected_offsets, 8, -1.0, side="left"))
    assert torch.equal(labels.cpu(), J.next_token_labels_flat(expected_values, expected_offsets))


def test_left_right_round_trip_with_total_never_syncs():
    ids = torch.arange(24).reshape(3, 8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    expected = J.left_right_to_jagged(ids, mask)
    ids_gpu, mask_gpu = ids.cuda(), mask.cuda()
    torch.cuda.synchronize()
    with _SyncForbidden():
        nt = J.left_right_to_jagged(ids_gpu, mask_gpu, total=12)
        back = J.jagged_to_left_right(nt, mask_gpu, padding_value=-1)
    assert torch.equal(nt.values().cpu(), expected.values())
    assert torch.equal(back.cpu(), torch.where(mask.bool(), ids, -1))
