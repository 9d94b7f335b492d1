"""Engine, model and optimizer configuration dataclasses, validated on construction.

A broken field raises :class:`ConfigFieldError` (a ``ValueError``; ``TypeError`` for a wrong
type) whose message starts with ``Owner.field:``. ``from_dict(data, where="algo.sft.optim")``
names fields by the caller's path instead (``algo.sft.optim.lr: ...``), so a Hydra front end
reports the key the user typed without rewriting messages.
"""
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
# torch's AdamW kernels: "auto" is torch's own choice (per-tensor loop on CPU), "foreach"
# batches every tensor into a few multi-tensor ops, "fused" is one kernel per step.
ADAMW_IMPLS = ("auto", "for_loop", "foreach", "fused")
# torchtitan's names: "default" reshards decoder layers after forward and lets FSDP2 decide
# for the root; "always" reshards everything; "never" keeps every gathered parameter.
RESHARD_POLICIES = ("default", "always", "never")
# The fused head's chunk kernels: "eager" torch ops (the reference), "compiled" through
# torch.compile, "auto" compiled where the backend declares torch.compile usable and worth it.
FUSED_KERNEL_IMPLS = ("auto", "eager", "compiled")


class ConfigFieldError(ValueError):
    """A config field with a bad value; ``owner`` and ``field`` name it, ``detail`` says why."""

    def __init__(self, owner: str, field: str, detail: str) -> None:
        self.owner, self.field, self.detail = owner, field, detail
        super().__init__(f"{owner}.{field}: {detail}")


class ConfigFieldTypeError(ConfigFieldError, TypeError):
    """A config field of the wrong type."""


def _choice(owner: str, field: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ConfigFieldError(owner, field, f"got {value!r}; allowed values: {', '.join(map(repr, allowed))}")


def _check_type(owner: str, field: str, value: Any, types: tuple, what: str) -> None:
    # bool is an int subclass; a stray True must not pass as a token budget.
    if isinstance(value, bool) and bool not in types:
        raise ConfigFieldTypeError(owner, field, f"expected {what}, got {value!r}")
    if not isinstance(value, types):
        raise ConfigFieldTypeError(owner, field, f"expected {what}, got {type(value).__name__} {value!r}")


def _finite_at_least(owner: str, field: str, value: Any, low: float, strict: bool, what: str) -> None:
    # NaN passes every "< 0" test and would silently turn the parameters into NaN.
    _check_type(owner, field, value, (int, float), what)
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
        raise ConfigFieldError(owner, field, f"expected {what}, got {value}")


class _FromDict:
    """``from_dict`` that rejects unknown keys and names fields by the caller's path."""

    @classmethod
    def from_dict(cls, data: dict | None, where: str | None = None):
        """Build from a mapping (e.g. a Hydra node); unknown keys and bad values raise,
        naming the key as ``where.key`` (default: the class name)."""
        where = where or cls.__name__
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigFieldError(where, unknown[0], f"unknown key; known keys: {', '.join(sorted(known))}")
        for key, value in data.items():
            # Hydra hands lists for tuples (betas).
            if isinstance(value, list):
                data[key] = tuple(value)
        try:
            return cls(**data)
        except ConfigFieldError as exc:
            raise type(exc)(where, exc.field, exc.detail) from None

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
            raise ConfigFieldError("ModelConfig", "preset", f"set exactly one of preset or path "
                                   f"(got preset={self.preset!r}, path={self.path!r})")
        if self.preset is not None:
            _choice("ModelConfig", "preset", self.preset, sorted(PRESETS))
        _choice("ModelConfig", "dtype", self.dtype, DTYPES)
        if self.attn_implementation is not None:
            _check_type("ModelConfig", "attn_implementation", self.attn_implementation, (str,), "a string or None")
        if self.vocab_size is not None:
            _check_type("ModelConfig", "vocab_size", self.vocab_size, (int,), "a positive int or None")
            if self.vocab_size < 2:
                raise ConfigFieldError("ModelConfig", "vocab_size", f"expected >= 2, got {self.vocab_size}")
        _check_type("ModelConfig", "seed", self.seed, (int,), "an int")


@dataclass
class EngineConfig(_FromDict):
    """How the engine runs the model: modes, FSDP2 policy, micro-batching, input checks.

    ``check_inputs`` validates batch values (token ids inside the vocabulary, 0/1 masks,
    finite per-token fields, positive temperatures) once per batch at the edge, in one
    device-to-host read; turn it off only for batches you trust.
    """

    use_remove_padding: bool = True
    use_fused_kernels: bool = False
    fused_kernel_impl: str = "auto"
    pad_mode: str = "no_padding"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    reshard_policy: str = "default"
    gradient_checkpointing: bool = False
    max_tokens_per_micro_batch: int | None = None
    check_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("use_remove_padding", "use_fused_kernels", "gradient_checkpointing", "check_inputs"):
            _check_type("EngineConfig", name, getattr(self, name), (bool,), "a bool")
        _choice("EngineConfig", "pad_mode", self.pad_mode, PAD_MODES)
        _choice("EngineConfig", "fused_kernel_impl", self.fused_kernel_impl, FUSED_KERNEL_IMPLS)
        _choice("EngineConfig", "param_dtype", self.param_dtype, DTYPES)
        _choice("EngineConfig", "reduce_dtype", self.reduce_dtype, DTYPES)
        _choice("EngineConfig", "reshard_policy", self.reshard_policy, RESHARD_POLICIES)
        if self.max_tokens_per_micro_batch is not None:
            _check_type("EngineConfig", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, (int,),
                        "a positive int or None")
            if self.max_tokens_per_micro_batch < 1:
                raise ConfigFieldError("EngineConfig", "max_tokens_per_micro_batch",
                                       f"expected >= 1 or None, got {self.max_tokens_per_micro_batch}")


@dataclass
class OptimConfig(_FromDict):
    """AdamW and its learning-rate schedule (``constant`` or ``warmup_cosine``).

    Both schedules warm up linearly over ``warmup_steps``; ``warmup_cosine`` then decays to
    ``min_lr_ratio * lr`` at ``total_steps``. ``grad_clip=None`` turns clipping off.
    ``impl`` picks torch's AdamW kernel (``auto``, ``for_loop``, ``foreach``, ``fused``): the
    same update, fewer (and faster) op launches for ``foreach``/``fused``.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    impl: str = "auto"

    def __post_init__(self) -> None:
        _choice("OptimConfig", "impl", self.impl, ADAMW_IMPLS)
        _finite_at_least("OptimConfig", "lr", self.lr, 0.0, False, "a finite number >= 0")
        _finite_at_least("OptimConfig", "weight_decay", self.weight_decay, 0.0, False, "a finite number >= 0")
        _finite_at_least("OptimConfig", "eps", self.eps, 0.0, True, "a finite number > 0")
        betas = self.betas if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
                                      for b in betas):
            raise ConfigFieldError("OptimConfig", "betas", f"expected two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(float(b) for b in self.betas)
        if self.grad_clip is not None:
            _finite_at_least("OptimConfig", "grad_clip", self.grad_clip, 0.0, True, "a finite number > 0 or None")
        _choice("OptimConfig", "lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _check_type("OptimConfig", "warmup_steps", self.warmup_steps, (int,), "an int >= 0")
        if self.warmup_steps < 0:
            raise ConfigFieldError("OptimConfig", "warmup_steps", f"expected >= 0, got {self.warmup_steps}")
        if self.total_steps is not None:
            _check_type("OptimConfig", "total_steps", self.total_steps, (int,), "an int >= 1 or None")
        _check_type("OptimConfig", "min_lr_ratio", self.min_lr_ratio, (int, float), "a number in [0, 1]")
        if self.lr_scheduler == "warmup_cosine":
            if self.total_steps is None or self.total_steps < 1:
                raise ConfigFieldError("OptimConfig", "total_steps", f"lr_scheduler='warmup_cosine' needs "
                                       f"total_steps >= 1, got {self.total_steps!r}")
            if self.warmup_steps > self.total_steps:
                raise ConfigFieldError("OptimConfig", "warmup_steps",
                                       f"expected <= total_steps={self.total_steps}, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigFieldError("OptimConfig", "min_lr_ratio", f"expected in [0, 1], got {self.min_lr_ratio}")
