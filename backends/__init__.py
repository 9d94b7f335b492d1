"""Device abstraction: the only package in polyfsdp that names a device.

``get_backend()`` picks npu, cuda or cpu; ``available_backends()`` says which can run
here and why not; ``init_distributed()`` sets up torch.distributed and the device mesh.
"""
from .base import Backend, BackendUnavailableError
from .distributed import destroy_distributed, init_distributed
from .registry import AUTO_ORDER, BACKEND_NAMES, ENV_OVERRIDE, BackendStatus, available_backends, get_backend

__all__ = [
    "AUTO_ORDER",
    "BACKEND_NAMES",
    "ENV_OVERRIDE",
    "Backend",
    "BackendStatus",
    "BackendUnavailableError",
    "available_backends",
    "destroy_distributed",
    "get_backend",
    "init_distributed",
]
