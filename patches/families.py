"""The gated decoder families polyfsdp patches; one line each (shared code in gated_decoder)."""
from __future__ import annotations

from .gated_decoder import FamilySpec, build_patches
from .registry import register

FAMILIES = (
    FamilySpec("qwen2", ("qwen2",), "transformers.models.qwen2.modeling_qwen2", "Qwen2", qk_norm=False),
    FamilySpec("qwen3", ("qwen3",), "transformers.models.qwen3.modeling_qwen3", "Qwen3", qk_norm=True),
    FamilySpec("llama", ("llama",), "transformers.models.llama.modeling_llama", "Llama", qk_norm=False),
    # Vision-language: the text decoder's norms and MLPs only (gated_decoder.py's docstring).
    FamilySpec("qwen2_vl", ("qwen2_vl",), "transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VL",
               qk_norm=False, class_names=(("MLP", "Qwen2MLP"),), vision_language=True),
    FamilySpec("qwen2_5_vl", ("qwen2_5_vl",), "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VL",
               qk_norm=False, class_names=(("MLP", "Qwen2MLP"),), vision_language=True),
    FamilySpec("qwen3_vl", ("qwen3_vl",), "transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLText",
               qk_norm=True, vision_language=True),
)

for _spec in FAMILIES:
    for _patch in build_patches(_spec):
        register(_patch)
