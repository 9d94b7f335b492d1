"""The CUDA backend (NVIDIA GPUs, NCCL)."""
from __future__ import annotations

import importlib.util

import torch

from .base import Backend

FLASH_ATTN_DTYPES = (torch.bfloat16, torch.float16)


class CUDABackend(Backend):
    """NVIDIA GPUs through torch.cuda."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    # Without flash-attn, or for fp32 compute: polyfsdp's per-sequence SDPA (varlen-equivalent).
    default_attn_implementation = "polyfsdp_varlen_sdpa"
    alloc_conf_variable = "PYTORCH_CUDA_ALLOC_CONF"
    server_devices_variable = "CUDA_VISIBLE_DEVICES"
    # vLLM's own NCCL engine: the weights go GPU to GPU (untested here: no GPU in CI).
    server_weight_transfer = "nccl"

    def availability(self) -> str | None:
        if not torch.cuda.is_available():
            if torch.version.cuda is None:
                return "this torch build has no CUDA support (CPU-only wheel)"
            return "torch has CUDA support but no GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        return None

    def attn_implementation(self, compute_dtype: torch.dtype) -> str:
        # Varlen flash attention where installed, but only for half-precision compute: FA2
        # kernels take fp16/bf16 only, and transformers would hand them fp32 tensors.
        if compute_dtype in FLASH_ATTN_DTYPES and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return self.default_attn_implementation

    def compile_unsupported(self) -> str | None:
        # Inductor turns the compiled code into Triton kernels on NVIDIA GPUs.
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs triton (pip install triton)"
        return None
