"""The CPU backend: first-class, what CI and every developer machine run on."""
from __future__ import annotations

import os

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

    def availability(self) -> str | None:
        return None

    def device_count(self) -> int:
        # Any number of local ranks can share the host; one per core is the useful limit.
        return os.cpu_count() or 1

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")
