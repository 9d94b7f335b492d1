"""Tiny config-built models, by preset name, for tests, benchmarks and the built-in task."""
from __future__ import annotations

from typing import Callable

from transformers import (Gemma2Config, LlamaConfig, PretrainedConfig, Qwen2_5_VLConfig, Qwen2Config, Qwen2VLConfig,
                          Qwen3Config, Qwen3VLConfig)

_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _qwen2(**overrides) -> PretrainedConfig:
    return Qwen2Config(**{**_COMMON, "tie_word_embeddings": False, "use_sliding_window": False, **overrides})


def _qwen3(**overrides) -> PretrainedConfig:
    return Qwen3Config(**{**_COMMON, "head_dim": 8, "tie_word_embeddings": False,
                          "use_sliding_window": False, **overrides})


def _llama(**overrides) -> PretrainedConfig:
    return LlamaConfig(**{**_COMMON, "tie_word_embeddings": False, **overrides})


def _gemma2(**overrides) -> PretrainedConfig:
    # A small final soft-cap and sliding window so both visibly change the numbers; the
    # attention soft-cap is off (SDPA-based attention cannot apply it).
    return Gemma2Config(**{**_COMMON, "head_dim": 8, "query_pre_attn_scalar": 8, "final_logit_softcapping": 2.0,
                           "attn_logit_softcapping": None, "sliding_window": 4, **overrides})


# Vision-language presets (docs/vision-language.md): the tiny text decoder above under a two-block
# vision tower of 14x14 patches merged 2x2, so a 28x28 image is one image token and a 56x56 one
# four. mrope_section splits the 4 rotary frequencies of an 8-wide head over (t, h, w). The
# special tokens sit at the top of the 128-token vocabulary.
VLM_TOKENS = dict(vision_start_token_id=124, vision_end_token_id=125, image_token_id=126, video_token_id=127)
# The text configs' default bos/eos ids (151643, 151645) lie outside the tiny vocabulary.
_VLM_TEXT = {**_COMMON, "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}}
_VISION = dict(depth=2, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def _vlm(config_class, vision: dict, merger_out: str, text_extra: dict | None = None,
         **overrides) -> PretrainedConfig:
    # Text fields (vocab_size, num_hidden_layers, ...) belong to the text config; the rest to the whole.
    text = {**_VLM_TEXT, **(text_extra or {})}
    outer = {}
    for key, value in overrides.items():
        (text if key in text else outer)[key] = value
    if "rope_parameters" in (text_extra or {}):
        text["rope_parameters"] = {**_VLM_TEXT["rope_parameters"], **text_extra["rope_parameters"]}
    # The merger projects image features into the decoder's width (``merger_out``: the family's key).
    vision = {**vision, merger_out: text["hidden_size"]}
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **VLM_TOKENS, **outer)


def _qwen2_vl(**overrides) -> PretrainedConfig:
    return _vlm(Qwen2VLConfig, {**_VISION, "embed_dim": 32, "mlp_ratio": 2}, "hidden_size", **overrides)


def _qwen2_5_vl(**overrides) -> PretrainedConfig:
    # Window attention over 56-pixel windows in block 0, full attention in block 1.
    return _vlm(Qwen2_5_VLConfig, {**_VISION, "hidden_size": 32, "intermediate_size": 64,
                                   "window_size": 56, "fullatt_block_indexes": [1]}, "out_hidden_size", **overrides)


def _qwen3_vl(**overrides) -> PretrainedConfig:
    # Interleaved mrope, and block 0's features added into the first decoder layer (deepstack).
    return _vlm(Qwen3VLConfig, {**_VISION, "hidden_size": 32, "intermediate_size": 64,
                                "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}, "out_hidden_size",
                {"head_dim": 8, "rope_parameters": {"mrope_interleaved": True}}, **overrides)


# Benchmark size (Qwen2-style, 4 layers, hidden 256, 8 heads x 32), as in the measurements.
_SMALL = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)

PRESETS: dict[str, Callable[..., PretrainedConfig]] = {
    "qwen2-tiny": _qwen2,
    "qwen2-tiny-tied": lambda **o: _qwen2(**{"tie_word_embeddings": True, **o}),
    "qwen3-tiny": _qwen3,
    "llama-tiny": _llama,
    "gemma2-tiny": _gemma2,
    "qwen2-small": lambda **o: _qwen2(**{**_SMALL, **o}),
    "qwen2-vl-tiny": _qwen2_vl,
    "qwen2.5-vl-tiny": _qwen2_5_vl,
    "qwen3-vl-tiny": _qwen3_vl,
}


def preset_config(name: str, **overrides) -> PretrainedConfig:
    """Build the Hugging Face config of preset ``name``; ``overrides`` replace its fields."""
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    try:
        return PRESETS[name](**overrides)
    except Exception as exc:
        # Transformers' configs validate fields through huggingface_hub's strict dataclasses, whose
        # errors are neither ValueError nor TypeError and span lines: one line naming the key instead.
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        text = " ".join(str(cause).split()) or type(cause).__name__
        raise ValueError(f"model.overrides: {text}") from None
