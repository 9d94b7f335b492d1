"""The gated decoder families polyfsdp patches; one line each (shared code in gated_decoder)."""
from __future__ import annotations

from .gated_decoder import FamilySpec, build_patches
from .registry import register

FAMILIES = (
    FamilySpec("qwen2", ("qwen2",), "transformers.models.qwen2.modeling_qwen2", "Qwen2", qk_norm=False),
    FamilySpec("qwen3", ("qwen3",), "transformers.models.qwen3.modeling_qwen3", "Qwen3", qk_norm=True),
    FamilySpec("llama", ("llama",), "transformers.models.llama.modeling_llama", "Llama", qk_norm=False),
)

for _spec in FAMILIES:
    for _patch in build_patches(_spec):
        register(_patch)
