"""The collective helpers are no-ops on one rank: without a process group and in a group of one."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from polyfsdp.backends import (
    all_gather_object,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    destroy_distributed,
    get_backend,
    init_distributed,
)


def _check_single_rank_results():
    values = [1.5, -2.0]
    assert all_reduce_sum(values, "cpu") is values
    assert all_reduce_max(values, "cpu") is values
    assert all_reduce_sum([], "cpu") == []
    tensor = torch.tensor([3.0, 4.0])
    assert all_reduce_sum(tensor) is tensor and torch.equal(tensor, torch.tensor([3.0, 4.0]))
    assert all_reduce_max(tensor) is tensor and torch.equal(tensor, torch.tensor([3.0, 4.0]))
    assert all_gather_object({"a": 1}) == [{"a": 1}]
    marker = object()
    assert broadcast_object(marker) is marker
    barrier()


def test_collectives_without_a_process_group_return_their_input(monkeypatch):
    # An earlier in-process test may have left its group of one behind: hide it.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    _check_single_rank_results()


def test_collectives_in_a_group_of_one_return_their_input(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    owned = not dist.is_initialized()
    init_distributed(get_backend("cpu"))
    try:
        assert dist.get_world_size() == 1
        _check_single_rank_results()
    finally:
        if owned:
            destroy_distributed()


@pytest.mark.parametrize("reduce", [all_reduce_sum, all_reduce_max])
def test_reducing_a_list_needs_the_device(reduce):
    with pytest.raises(TypeError, match=f"{reduce.__name__}: a list of values needs device="):
        reduce([1.0])
