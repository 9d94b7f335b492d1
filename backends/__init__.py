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

# What the package exports, by the submodule that defines it. Loaded on first use (PEP 562), so
# `import polyfsdp.backends` sets the guard above without importing torch: `polyfsdp-train --help`
# and a mistyped key answer before torch (seconds) would have loaded.
_EXPORTS = {
    "base": ("Backend", "BackendUnavailableError"),
    "distributed": ("all_gather_object", "all_reduce_max", "all_reduce_sum", "barrier", "broadcast_object",
                    "current_rank", "current_world_size", "destroy_distributed", "init_distributed"),
    "registry": ("AUTO_ORDER", "BACKEND_NAMES", "ENV_OVERRIDE", "BackendStatus", "available_backends",
                 "get_backend"),
    "topology": ("LaunchEnv", "Topology", "launch_env"),
}
_SOURCE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _SOURCE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
