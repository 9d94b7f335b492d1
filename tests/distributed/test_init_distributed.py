"""init_distributed: two torchrun processes per backend (gloo always; nccl/hccl with two devices), and
the single-process fallback on gloo."""
import os

import torch
import torch.distributed as dist

from polyfsdp.backends import destroy_distributed, get_backend, init_distributed
from torchrun_launcher import run_torchrun

HERE = os.path.dirname(__file__)


def test_two_process_group_all_reduces(dist_backend):
    result = run_torchrun(os.path.join(HERE, "worker_init_distributed.py"), nproc=2, backend=dist_backend)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank="))
    backend = get_backend(dist_backend)
    tail = f"world=2 mesh=2 backend={backend.dist_backend} device={backend.device_type} sum=3.0"
    assert lines == [f"rank=0 {tail}", f"rank=1 {tail}"]


def test_single_process_without_torchrun_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    mesh = init_distributed(get_backend("cpu"))
    try:
        assert dist.get_world_size() == 1 and mesh.size() == 1
        value = torch.ones(2)
        dist.all_reduce(value)
        assert torch.equal(value, torch.ones(2))
    finally:
        destroy_distributed()
    assert not dist.is_initialized()


def test_teardown_barrier_outlives_the_interpreter(monkeypatch):
    """The exit barrier's work handle is kept for good: a gloo worker thread that dropped its
    last reference during interpreter finalisation aborted a finished run (SIGABRT, see
    backends.distributed._keep_until_exit). Without the barrier nothing is kept."""
    import sys

    from polyfsdp.backends import distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    kept = len(distributed._KEPT_WORK)
    init_distributed(get_backend("cpu"))
    destroy_distributed()
    assert len(distributed._KEPT_WORK) == kept + 1
    barrier = distributed._KEPT_WORK[-1]
    assert barrier.is_completed()
    # The list, this name, getrefcount's argument, and the reference never released.
    assert sys.getrefcount(barrier) >= 4

    init_distributed(get_backend("cpu"))
    destroy_distributed(wait_for_peers=False)
    assert len(distributed._KEPT_WORK) == kept + 1 and not dist.is_initialized()


def test_world_size_without_master_addr_is_a_clear_error(monkeypatch):
    import pytest

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but MASTER_ADDR is unset"):
        init_distributed(get_backend("cpu"))
