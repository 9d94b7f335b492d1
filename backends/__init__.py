"""Device abstraction: the only package in polyfsdp that names a device.

``get_backend()`` picks npu, cuda or cpu; ``available_backends()`` says which can run
here and why not; ``init_distributed()`` sets up torch.distributed and the device mesh;
``topology.topology()`` says which rank is which and which ranks share a batch;
``all_reduce_sum``/``all_reduce_max``/``all_gather_object``/``broadcast_object``/``barrier``
are collectives that are no-ops on a single rank.
"""
import os

# `import torch` loads every installed device extension through entry points, so a
# torch_npu without CANN makes `import torch` itself fail. polyfsdp imports this package
# before torch and turns that auto-loading off (unless the user set it), so the NPU
# backend imports torch_npu lazily and can explain a failure in plain words.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from .base import Backend, BackendUnavailableError  # noqa: E402  (after the guard above)
from .distributed import (
    all_gather_object,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    current_rank,
    current_world_size,
    destroy_distributed,
    init_distributed,
)
from .topology import LaunchEnv, Topology, launch_env
from .registry import AUTO_ORDER, BACKEND_NAMES, ENV_OVERRIDE, BackendStatus, available_backends, get_backend

__all__ = [
    "AUTO_ORDER",
    "BACKEND_NAMES",
    "ENV_OVERRIDE",
    "Backend",
    "BackendStatus",
    "BackendUnavailableError",
    "LaunchEnv",
    "Topology",
    "all_gather_object",
    "all_reduce_max",
    "all_reduce_sum",
    "available_backends",
    "barrier",
    "broadcast_object",
    "current_rank",
    "current_world_size",
    "destroy_distributed",
    "get_backend",
    "init_distributed",
    "launch_env",
]
