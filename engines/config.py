"""Engine and model configuration dataclasses, validated on construction."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .presets import PRESETS

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES = tuple(TORCH_DTYPES)
PAD_MODES = ("no_padding", "left_right")
LR_SCHEDULERS = ("constant", "warmup_cosine")


def _choice(owner: str, field: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{field}: got {value!r}; allowed values: {', '.join(map(repr, allowed))}")


def _check_type(owner: str, field: str, value: Any, types: tuple, what: str) -> None:
    # bool is an int subclass; a stray True must not pass as a token budget.
    if isinstance(value, bool) and bool not in types:
        raise TypeError(f"{owner}.{field}: expected {what}, got {value!r}")
    if not isinstance(value, types):
        raise TypeError(f"{owner}.{field}: expected {what}, got {type(value).__name__} {value!r}")


class _FromDict:
    """``from_dict`` that rejects unknown keys, naming them and the known fields."""

    @classmethod
    def from_dict(cls, data: dict | None):
        """Build from a mapping (e.g. a Hydra node); unknown keys raise ValueError."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known keys: {sorted(known)}")
        for key, value in data.items():
            # Hydra hands lists for tuples (betas).
            if isinstance(value, list):
                data[key] = tuple(value)
        return cls(**data)

    def to_dict(self) -> dict:
        """Plain-dict view (for logging and checkpoint metadata)."""
        return dataclasses.asdict(self)


@dataclass
class ModelConfig(_FromDict):
    """Which model to build: a tiny ``preset`` (config-built) or a local HF checkpoint ``path``.

    ``attn_implementation=None`` uses the backend's choice; ``vocab_size`` overrides a preset's
    vocabulary (e.g. for the trainer's character tokenizer).
    """

    preset: str | None = None
    path: str | None = None
    dtype: str = "float32"
    attn_implementation: str | None = None
    vocab_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.path is None):
            raise ValueError(f"ModelConfig: set exactly one of preset or path "
                             f"(got preset={self.preset!r}, path={self.path!r})")
        if self.preset is not None:
            _choice("ModelConfig", "preset", self.preset, sorted(PRESETS))
        _choice("ModelConfig", "dtype", self.dtype, DTYPES)
        if self.attn_implementation is not None:
            _check_type("ModelConfig", "attn_implementation", self.attn_implementation, (str,), "a string or None")
        if self.vocab_size is not None:
            _check_type("ModelConfig", "vocab_size", self.vocab_size, (int,), "a positive int or None")
            if self.vocab_size < 2:
                raise ValueError(f"ModelConfig.vocab_size: expected >= 2, got {self.vocab_size}")
        _check_type("ModelConfig", "seed", self.seed, (int,), "an int")


@dataclass
class EngineConfig(_FromDict):
    """How the engine runs the model (modes, FSDP2 policy, micro-batching) and trains it."""

    use_remove_padding: bool = True
    use_fused_kernels: bool = False
    pad_mode: str = "no_padding"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    reshard_after_forward: bool = True
    gradient_checkpointing: bool = False
    max_tokens_per_micro_batch: int | None = None
    # Training.
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 1.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        for name in ("use_remove_padding", "use_fused_kernels", "reshard_after_forward", "gradient_checkpointing"):
            _check_type("EngineConfig", name, getattr(self, name), (bool,), "a bool")
        _choice("EngineConfig", "pad_mode", self.pad_mode, PAD_MODES)
        _choice("EngineConfig", "param_dtype", self.param_dtype, DTYPES)
        _choice("EngineConfig", "reduce_dtype", self.reduce_dtype, DTYPES)
        if self.max_tokens_per_micro_batch is not None:
            _check_type("EngineConfig", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, (int,),
                        "a positive int or None")
            if self.max_tokens_per_micro_batch < 1:
                raise ValueError(f"EngineConfig.max_tokens_per_micro_batch: expected >= 1 or None, "
                                 f"got {self.max_tokens_per_micro_batch}")
        # NaN passes every "< 0" test and would silently turn the parameters into NaN.
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            _check_type("EngineConfig", name, value, (int, float), "a number")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"EngineConfig.{name}: expected a finite number >= 0, got {value}")
        betas = self.betas if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
                                      for b in betas):
            raise ValueError(f"EngineConfig.betas: expected two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(float(b) for b in self.betas)
        if self.grad_clip is not None:
            _check_type("EngineConfig", "grad_clip", self.grad_clip, (int, float), "a positive number or None")
            if not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
                raise ValueError(f"EngineConfig.grad_clip: expected a finite number > 0 or None, got {self.grad_clip}")
        _choice("EngineConfig", "lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _check_type("EngineConfig", "warmup_steps", self.warmup_steps, (int,), "an int >= 0")
        if self.warmup_steps < 0:
            raise ValueError(f"EngineConfig.warmup_steps: expected >= 0, got {self.warmup_steps}")
        if self.total_steps is not None:
            _check_type("EngineConfig", "total_steps", self.total_steps, (int,), "an int >= 1 or None")
        _check_type("EngineConfig", "min_lr_ratio", self.min_lr_ratio, (int, float), "a number in [0, 1]")
        if self.lr_scheduler == "warmup_cosine":
            if self.total_steps is None or self.total_steps < 1:
                raise ValueError(f"EngineConfig.total_steps: lr_scheduler='warmup_cosine' needs total_steps >= 1, "
                                 f"got {self.total_steps!r}")
            if self.warmup_steps > self.total_steps:
                raise ValueError(f"EngineConfig.warmup_steps: expected <= total_steps={self.total_steps}, "
                                 f"got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"EngineConfig.min_lr_ratio: expected in [0, 1], got {self.min_lr_ratio}")
