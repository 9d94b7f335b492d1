"""Tiny config-built models, by preset name, for tests, benchmarks and the built-in task."""
from __future__ import annotations

from typing import Callable

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

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


PRESETS: dict[str, Callable[..., PretrainedConfig]] = {
    "qwen2-tiny": _qwen2,
    "qwen2-tiny-tied": lambda **o: _qwen2(**{"tie_word_embeddings": True, **o}),
    "qwen3-tiny": _qwen3,
    "llama-tiny": _llama,
}


def preset_config(name: str, **overrides) -> PretrainedConfig:
    """Build the Hugging Face config of preset ``name``; ``overrides`` replace its fields."""
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name](**overrides)
