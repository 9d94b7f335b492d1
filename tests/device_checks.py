"""Checks every accelerator backend must pass, shared by tests/cuda and tests/npu."""
import torch


def assert_rng_state_restores_draws(backend) -> None:
    """Restoring ``backend.get_rng_state()`` replays the same device draws."""
    backend.manual_seed(11)
    state = backend.get_rng_state()
    assert set(state) == {backend.device_type}
    first = torch.rand(4, device=backend.device(0))
    backend.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=backend.device(0)), first)
