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

    def compile_unsupported(self) -> str | None:
        # Inductor turns the compiled code into Triton kernels on NVIDIA GPUs.
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs triton (pip install triton)"
        return None
