"""``EngineConfig.offload``: what lives in host memory between uses.

``optimizer`` keeps the AdamW state on the host and runs the step there
(engines/parallel/host_optimizer.py); parameters and gradients stay on the device. ``params`` hands
FSDP2 its ``CPUOffloadPolicy``: parameter shards and gradients live in (pinned) host memory
and are copied to the device per layer for forward and backward; the optimizer, built over
those host shards, keeps its state and runs its step on the host. On the CPU backend
everything already lives on the host, so offload is a no-op there, with a one-line notice
instead of an error (the same config runs everywhere); the backend says so with
``memory_is_host``.
"""
from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from polyfsdp.backends.distributed import all_reduce_sum

from ..config import OFFLOAD_MODES

logger = logging.getLogger(__name__)

def offload_applies(mode: str, backend) -> bool:
    """Whether ``EngineConfig.offload=mode`` moves anything on ``backend``: not for ``none``,
    and not where device memory is host memory (a one-line notice, not an error)."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"EngineConfig.offload: got {mode!r}; allowed values: {', '.join(map(repr, OFFLOAD_MODES))}")
    if mode == "none":
        return False
    if backend.memory_is_host:
        logger.warning("EngineConfig.offload=%r does nothing on the %s backend: parameters, gradients and "
                       "optimizer state already live in host memory", mode, backend.name)
        return False
    return True


def offload_policy(mode: str, backend) -> CPUOffloadPolicy | None:
    """FSDP2's offload policy for ``EngineConfig.offload`` on ``backend``; None unless ``params`` applies."""
    if mode != "params" or not offload_applies(mode, backend):
        return None
    return CPUOffloadPolicy(pin_memory=True)


def optimizer_on_host(mode: str, backend) -> bool:
    """Whether the AdamW state and step go to the host (``offload=optimizer`` on an accelerator)."""
    return mode == "optimizer" and offload_applies(mode, backend)


def host_grad_norm(grads: list, device) -> torch.Tensor:
    """Global L2 norm of FSDP2-sharded gradients that live on the host (CPU offload), as a
    tensor on ``device``: each rank's shard norm goes to the device for the sum over ranks,
    because the process group of an accelerator cannot reduce host tensors. FSDP2 shards are
    disjoint (dim-0 shards, zero padding), so the squared local norms add up exactly."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squared = torch.nn.utils.get_total_norm(local, norm_type=2.0).to(device=device, dtype=torch.float32) ** 2
    all_reduce_sum(squared)
    return squared.sqrt()
