"""The CUDA backend (NVIDIA GPUs, NCCL)."""
from __future__ import annotations

import importlib.util

import torch

from .base import Backend


class CUDABackend(Backend):
    """NVIDIA GPUs through torch.cuda."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def availability(self) -> str | None:
        if not torch.cuda.is_available():
            if torch.version.cuda is None:
                return "this torch build has no CUDA support (CPU-only wheel)"
            return "torch has CUDA support but no GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        return None

    @property
    def default_attn_implementation(self) -> str:  # type: ignore[override]
        # Varlen flash attention where installed; else polyfsdp's per-sequence SDPA.
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return "polyfsdp_varlen_sdpa"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, local_rank: int = 0) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    @property
    def supports_bf16(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def get_rng_state(self) -> dict:
        return {"cuda": torch.cuda.get_rng_state_all()}

    def set_rng_state(self, state: dict) -> None:
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
