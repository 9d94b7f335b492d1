"""``EngineConfig.offload=optimizer``: AdamW whose state lives in host memory and whose step
runs on the host, while parameters and gradients stay on the device.

FSDP2 has no optimizer-only offload policy, so this is an ``AdamW`` subclass: its
``param_groups`` hold the model's (device, possibly DTensor) parameters, so the learning-rate
scheduler and DCP checkpoints (``get_state_dict`` maps parameters to names) treat it like any
AdamW; only ``state`` differs, holding host tensors (DTensors with host local shards when the
parameter is sharded, so DCP saves each rank's shard). ``step`` goes one parameter at a time:
its local shard and (already clipped) gradient shard are copied to the host, torch's own
single-tensor AdamW math runs there, and the result is copied back into the device shard in
place. One parameter's shard at a time is the host's only extra memory besides the state;
the copies are synchronous (correct first; overlapping them with the step is left to do).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_math

HOST = torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like_on_host(param: torch.Tensor, local_host: torch.Tensor) -> torch.Tensor:
    """``local_host`` (a host tensor shaped like ``param``'s local shard) laid out like
    ``param``: a DTensor with the same mesh and placements when ``param`` is one."""
    if isinstance(param, DTensor):
        # DTensor.from_local would move the local tensor to the mesh's device; FSDP2's CPU
        # offload builds its host-backed DTensors this same way (same spec, no copy).
        return DTensor(local_host, param._spec, requires_grad=False)
    return local_host


class HostAdamW(torch.optim.AdamW):
    """AdamW with its state in host memory and its step on the host (module docstring).
    Supports what OptimConfig sets: lr, betas, eps, weight_decay (no amsgrad/maximize)."""

    def __init__(self, params, **kwargs):
        for name in ("amsgrad", "maximize", "capturable", "differentiable", "fused", "foreach"):
            if kwargs.get(name):
                raise ValueError(f"HostAdamW: {name}=True is not supported (the host step is torch's for-loop AdamW)")
        super().__init__(params, **kwargs)

    def _host_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            zeros = lambda: _like_on_host(param, torch.zeros_like(_local(param), device=HOST))  # noqa: E731
            # torch's non-capturable AdamW keeps its step count as a float32 host scalar too.
            state.update(step=torch.tensor(0.0, dtype=torch.float32), exp_avg=zeros(), exp_avg_sq=zeros())
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._host_state(param)
                device_shard = _local(param)
                host_param = device_shard.to(HOST, copy=True)
                host_grad = _local(param.grad).to(HOST, copy=True)
                adam_math([host_param], [host_grad], [_local(state["exp_avg"])], [_local(state["exp_avg_sq"])], [],
                          [state["step"]], foreach=False, fused=False, decoupled_weight_decay=True,
                          amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                          weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                device_shard.copy_(host_param)
        return loss

    def load_state_dict(self, state_dict):
        """Load as AdamW does (which moves floating state to each parameter's device), then
        move the state back to the host."""
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value) and _local(value).device != HOST:
                    state[key] = _like_on_host(param, _local(value).to(HOST))
