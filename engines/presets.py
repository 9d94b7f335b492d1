"""Tiny config-built models, by preset name, for tests, benchmarks and the built-in task."""
from __future__ import annotations

from typing import Callable

from transformers import Gemma2Config, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

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
