"""The device-backend contract: everything the rest of polyfsdp may ask of a device."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot be used here; the message says why."""


class Backend(ABC):
    """One device family (cpu, cuda, npu). Subclasses are the only code naming a device."""

    name: str
    device_type: str
    dist_backend: str
    visible_devices_env: str | None = None
    # Attention implementation name passed to transformers; the engine registers
    # polyfsdp's own implementations before building a model.
    default_attn_implementation: str = "sdpa"

    @abstractmethod
    def availability(self) -> str | None:
        """Return None when usable, else a plain-words reason why not."""

    def is_available(self) -> bool:
        """True when this backend can run here."""
        return self.availability() is None

    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device a process with this local rank should use."""
        return torch.device(self.device_type, local_rank)

    @abstractmethod
    def device_count(self) -> int:
        """Number of visible devices of this type."""

    def set_device(self, local_rank: int = 0) -> None:
        """Bind the current process to its device (no-op where meaningless)."""

    def synchronize(self) -> None:
        """Wait for all queued device work."""

    def empty_cache(self) -> None:
        """Release cached device memory back to the driver."""

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and every device generator of this backend."""
        torch.manual_seed(seed)

    def memory_allocated(self) -> int:
        """Bytes currently allocated by tensors on the device."""
        return 0

    def max_memory_allocated(self) -> int:
        """Peak bytes allocated since the last reset."""
        return 0

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-memory measurement window."""

    @property
    def supports_bf16(self) -> bool:
        """Whether bfloat16 compute is supported natively."""
        return True

    def fused_ops(self) -> dict[str, Callable]:
        """Fused kernels this backend offers, by op name (``rms_norm``, ``rotary_mul``,
        ``swiglu``, ``fusion_attention``). Patches are written against this table."""
        return {}

    def get_rng_state(self) -> dict:
        """RNG state of the device generators (CPU state is saved separately)."""
        return {}

    def set_rng_state(self, state: dict) -> None:
        """Restore what :meth:`get_rng_state` returned."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"
