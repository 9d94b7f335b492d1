"""``EngineConfig.offload``: where FSDP2 keeps the sharded state between uses.

``params`` hands FSDP2 its ``CPUOffloadPolicy``: parameter shards and gradients live in
(pinned) host memory and are copied to the device per layer for forward and backward; the
optimizer, built over those host shards, keeps its state and runs its step on the host. On
the CPU backend everything already lives on the host, so offload is a no-op there, with a
one-line notice instead of an error (the same config runs everywhere).
"""
from __future__ import annotations

import logging

from torch.distributed.fsdp import CPUOffloadPolicy

logger = logging.getLogger(__name__)

HOST_DEVICE_TYPE = "cpu"


def offload_policy(mode: str, backend) -> CPUOffloadPolicy | None:
    """FSDP2's offload policy for ``EngineConfig.offload`` on ``backend``; None for no offload."""
    if mode == "none":
        return None
    if mode != "params":
        raise ValueError(f"EngineConfig.offload: got {mode!r}; allowed values: 'none', 'params'")
    if backend.device_type == HOST_DEVICE_TYPE:
        logger.warning("EngineConfig.offload=%r does nothing on the %s backend: parameters, gradients and "
                       "optimizer state already live in host memory", mode, backend.device_type)
        return None
    return CPUOffloadPolicy(pin_memory=True)
