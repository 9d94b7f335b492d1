"""On an Ascend NPU: a tensor round-trips through the device, the device RNG state restores,
and init_distributed binds it."""
import torch
import torch.distributed as dist

from polyfsdp.backends import destroy_distributed, get_backend, init_distributed
from tests.device_checks import assert_rng_state_restores_draws


def test_tensor_round_trip_through_the_npu():
    backend = get_backend("npu")
    x = torch.arange(10, dtype=torch.float32)
    on_device = x.to(backend.device(0)) * 2
    backend.synchronize()
    assert on_device.device.type == "npu"
    assert torch.equal(on_device.cpu(), x * 2)
    assert set(backend.fused_ops()) >= {"rms_norm", "rotary_mul", "swiglu", "fusion_attention"}


def test_device_rng_state_restores_the_same_draws():
    assert_rng_state_restores_draws(get_backend("npu"))


def test_init_distributed_single_process_uses_hccl(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    backend = get_backend("npu")
    mesh = init_distributed(backend)
    try:
        assert dist.get_backend() == "hccl" and mesh.device_type == "npu"
        value = torch.ones(3, device=backend.device(0))
        dist.all_reduce(value)
        assert value.sum().item() == 3.0
    finally:
        destroy_distributed()
