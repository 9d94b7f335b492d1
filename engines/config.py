"""Engine, model and optimizer configuration dataclasses, validated on construction.

A broken field raises :class:`ConfigFieldError` (a ``ValueError``; ``TypeError`` for a wrong
type) whose message starts with ``Owner.field:``. ``from_dict(data, where="algo.sft.optim")``
names fields by the caller's path instead (``algo.sft.optim.lr: ...``), so a Hydra front end
reports the key the user typed without rewriting messages.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Sequence

DTYPES = ("float32", "bfloat16", "float16")
PAD_MODES = ("no_padding", "left_right")
LR_SCHEDULERS = ("constant", "warmup_cosine")
# torch's AdamW kernels: "auto" is torch's own choice (per-tensor loop on CPU), "foreach"
# batches every tensor into a few multi-tensor ops, "fused" is one kernel per step.
ADAMW_IMPLS = ("auto", "for_loop", "foreach", "fused")
# torchtitan's names: "default" reshards decoder layers after forward and lets FSDP2 decide
# for the root; "always" reshards everything; "never" keeps every gathered parameter.
RESHARD_POLICIES = ("default", "always", "never")
# What lives in host memory between uses (engines/parallel/offload.py): nothing, the AdamW state (the
# step runs on the host), or FSDP2's parameter/gradient shards with the optimizer.
OFFLOAD_MODES = ("none", "optimizer", "params")
# The fused head's chunk kernels: "eager" torch ops (the reference), "compiled" through
# torch.compile, "auto" compiled where the backend declares torch.compile usable and worth it.
FUSED_KERNEL_IMPLS = ("auto", "eager", "compiled")


class TorchDtypes(Mapping):
    """:data:`DTYPES` -> torch's dtypes, imported on first lookup: declaring and checking a
    configuration (the trainer's --help, a mistyped key) must not import torch."""

    def _table(self) -> dict:
        import torch

        return {name: getattr(torch, name) for name in DTYPES}

    def __getitem__(self, name: str):
        return self._table()[name]

    def __iter__(self):
        return iter(DTYPES)

    def __len__(self) -> int:
        return len(DTYPES)


TORCH_DTYPES = TorchDtypes()


def setting(default: Any = dataclasses.MISSING, *, doc: str = "", low: float | None = None,
            high: float | None = None, entries: dict | None = None) -> Any:
    """A configuration field, declared once: its default (a list, dict or section class is
    built fresh per instance), what it means (``polyfsdp-train --help``,
    docs/config-reference.md) and, for a number, the range checked before anything runs
    (``low``/``high``; None: the trainer's default range, trainer/config/bounds.py). With
    ``entries`` the field is a free-form mapping handed to someone else: its numbers are only
    refused when not finite, except the entries it names, ``{key: (low, high)}``."""
    metadata = {"doc": doc, "low": low, "high": high, "entries": entries}
    if isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=metadata)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


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


# LoRA targets: module names (q_proj, ...) or "all-linear" (every linear layer but the LM head).
LORA_ALL_LINEAR = "all-linear"
# How a LoRA model is exported: adapters folded into the weights, or peft's adapter directory.
ADAPTER_EXPORTS = ("merged", "adapter")


@dataclass
class LoraConfig(_FromDict):
    """LoRA adapters through peft (engines/model/lora.py); ``rank=0`` means no adapters.

    ``target_modules``: module names or ``all-linear``. The LM head is never a target: the
    fused head reads its plain weight.
    """

    rank: int = setting(0, doc="adapter rank; 0 trains every weight (pip install -e \".[lora]\")", high=2**16)
    # alpha / rank scales every adapter's output: beyond 2**16 the first step is non-finite.
    alpha: float = setting(16.0, doc="adapter scale: alpha / rank", high=2**16)
    dropout: float = setting(0.0, doc="dropout on the adapters' inputs, in [0, 1)")
    target_modules: Any = setting(LORA_ALL_LINEAR, doc="all-linear, or module names, e.g. [q_proj, v_proj]")

    def __post_init__(self) -> None:
        _check_type("LoraConfig", "rank", self.rank, (int,), "an int >= 0 (0: no LoRA)")
        if self.rank < 0:
            raise ConfigFieldError("LoraConfig", "rank", f"expected >= 0 (0: no LoRA), got {self.rank}")
        _finite_at_least("LoraConfig", "alpha", self.alpha, 0.0, True, "a finite number > 0")
        _finite_at_least("LoraConfig", "dropout", self.dropout, 0.0, False, "a number in [0, 1)")
        if self.dropout >= 1.0:
            raise ConfigFieldError("LoraConfig", "dropout", f"expected a number in [0, 1), got {self.dropout}")
        targets = self.target_modules
        if isinstance(targets, str) and targets != LORA_ALL_LINEAR:
            targets = (targets,)
        if isinstance(targets, list):
            targets = tuple(targets)
        if not (targets == LORA_ALL_LINEAR or (isinstance(targets, tuple) and targets
                                                and all(isinstance(t, str) and t for t in targets))):
            raise ConfigFieldError("LoraConfig", "target_modules",
                                   f"expected {LORA_ALL_LINEAR!r} or a non-empty list of module names, got {targets!r}")
        if targets != LORA_ALL_LINEAR and "lm_head" in targets:
            raise ConfigFieldError("LoraConfig", "target_modules", "lm_head cannot take an adapter (the fused head "
                                   "reads its plain weight); use the decoder's linear layers")
        self.target_modules = targets

    @property
    def enabled(self) -> bool:
        """Whether adapters are added (rank > 0)."""
        return self.rank > 0


@dataclass
class ModelConfig(_FromDict):
    """Which model to build: a tiny ``preset`` (config-built) or a local HF checkpoint ``path``.

    ``attn_implementation=None`` uses the backend's choice; ``vocab_size`` overrides a preset's
    vocabulary (e.g. for the trainer's character tokenizer). ``value_head=True`` builds a
    critic: the LM head is replaced by a scalar head with weights ``N(0, value_head_init_std)``
    (seeded by ``seed``) and zero bias (engines/head/value.py), or loaded from
    ``value_head_path`` (a safetensors file with ``weight (1, hidden)`` and ``bias (1,)``, as
    :meth:`FSDPEngine.export_value_head` writes it). ``score_head=True`` builds a reward model
    (engines/head/score.py): a ``*ForSequenceClassification`` checkpoint (or preset), or a causal
    LM with the value head at ``value_head_path``, scoring each sequence at its last token.
    ``freeze_vision=True`` (a vision-language model) freezes the vision tower but its mergers
    (engines/model/vision.py).
    """

    preset: str | None = None
    path: str | None = None
    dtype: str = "float32"
    attn_implementation: str | None = None
    vocab_size: int | None = None
    seed: int = 0
    value_head: bool = False
    value_head_init_std: float = 0.01
    value_head_path: str | None = None
    score_head: bool = False
    lora: LoraConfig | dict | None = None
    freeze_vision: bool = False

    def __post_init__(self) -> None:
        if self.lora is None:
            self.lora = LoraConfig()
        elif isinstance(self.lora, dict):
            try:
                self.lora = LoraConfig.from_dict(self.lora)
            except ConfigFieldError as exc:
                raise type(exc)("ModelConfig", f"lora.{exc.field}", exc.detail) from None
        elif not isinstance(self.lora, LoraConfig):
            raise ConfigFieldTypeError("ModelConfig", "lora", f"expected a LoraConfig, a dict or None, "
                                       f"got {type(self.lora).__name__}")
        if (self.preset is None) == (self.path is None):
            raise ConfigFieldError("ModelConfig", "preset", f"set exactly one of preset or path "
                                   f"(got preset={self.preset!r}, path={self.path!r})")
        if self.preset is not None:
            from .presets import PRESETS  # transformers' configs: only where a model is described

            _choice("ModelConfig", "preset", self.preset, sorted(PRESETS))
        _choice("ModelConfig", "dtype", self.dtype, DTYPES)
        if self.attn_implementation is not None:
            _check_type("ModelConfig", "attn_implementation", self.attn_implementation, (str,), "a string or None")
        if self.vocab_size is not None:
            _check_type("ModelConfig", "vocab_size", self.vocab_size, (int,), "a positive int or None")
            if self.vocab_size < 2:
                raise ConfigFieldError("ModelConfig", "vocab_size", f"expected >= 2, got {self.vocab_size}")
        _check_type("ModelConfig", "seed", self.seed, (int,), "an int")
        _check_type("ModelConfig", "value_head", self.value_head, (bool,), "a bool")
        _check_type("ModelConfig", "score_head", self.score_head, (bool,), "a bool")
        _check_type("ModelConfig", "freeze_vision", self.freeze_vision, (bool,), "a bool")
        if self.score_head and self.value_head:
            raise ConfigFieldError("ModelConfig", "score_head", "a reward model's score head and a critic's value "
                                   "head exclude each other")
        _finite_at_least("ModelConfig", "value_head_init_std", self.value_head_init_std, 0.0, False,
                         "a finite number >= 0")
        if self.value_head_path is not None:
            _check_type("ModelConfig", "value_head_path", self.value_head_path, (str,), "a file path or None")
            if not (self.value_head or self.score_head):
                raise ConfigFieldError("ModelConfig", "value_head_path", "is set but value_head=False and "
                                       "score_head=False (a value head is loaded into a critic or a reward model)")


@dataclass
class EngineConfig(_FromDict):
    """How the engine runs the model: modes, FSDP2 policy, micro-batching, input checks.

    ``check_inputs`` validates batch values (token ids inside the vocabulary, 0/1 masks,
    finite per-token fields, positive temperatures) once per batch at the edge, in one
    device-to-host read; turn it off only for batches you trust. ``ulysses_sp_size`` splits
    each sequence over that many consecutive ranks (engines/parallel/sequence.py);
    ``balance_dp_tokens`` re-assigns sequences over data-parallel replicas by token count
    (engines/batch/dp_balance.py). ``fuse_loss_into_head`` (with ``use_fused_kernels``): a
    token-separable loss (SFTLoss, PPOLoss) has its gradient taken inside the fused head's
    forward, three GEMMs instead of four, same numbers (engines/head/fused_loss.py); other
    losses are unaffected.

    ``shard_single_rank=False`` (default) runs a one-rank world as the plain model: FSDP2 on
    one rank only adds hooks and DTensor dispatch to every forward, backward and optimizer
    step. The model is still sharded when ``param_dtype`` or ``reduce_dtype`` differs from
    the model's dtype (FSDP2's mixed precision does those casts). ``True`` always shards.
    """

    use_remove_padding: bool = setting(True, doc="pack sequences without padding (every mode gives the same numbers)")
    use_fused_kernels: bool = setting(False, doc="the fused chunked LM head")
    fused_kernel_impl: str = setting("auto", doc="auto | eager | compiled: the fused head's chunk kernels "
                                                 "(auto: compiled on GPUs/NPUs, eager on CPU)")
    fuse_loss_into_head: bool = setting(True, doc="with the fused head and a token-separable loss: the loss "
                                                  "gradient inside the head's forward (3 GEMMs, not 4)")
    pad_mode: str = setting("no_padding", doc="no_padding | left_right")
    param_dtype: str = setting("float32", doc="float32 | bfloat16 | float16")
    reduce_dtype: str = setting("float32", doc="float32 | bfloat16 | float16")
    reshard_policy: str = setting("default", doc="default | always | never (FSDP2 reshard after forward)")
    gradient_checkpointing: bool = setting(False, doc="recompute activations in the backward")
    max_tokens_per_micro_batch: int | None = setting(None, doc="null: the whole batch in one micro-batch")
    check_inputs: bool = setting(True, doc="validate batch values once per batch (one device read)")
    ulysses_sp_size: int = setting(1, doc="Ulysses sequence parallelism: ranks per data-parallel replica; "
                                          "must divide the world size")
    balance_dp_tokens: bool = setting(False, doc="re-assign sequences over ranks by tokens each batch")
    offload: str = setting("none", doc="none | optimizer (AdamW state + step on the host) | params (FSDP2 "
                                       "CPUOffloadPolicy); no-op on cpu")
    shard_single_rank: bool = setting(False, doc="true: FSDP2 even on one rank (false runs 1 rank as the "
                                                 "plain model)")

    def __post_init__(self) -> None:
        for name in ("use_remove_padding", "use_fused_kernels", "fuse_loss_into_head", "gradient_checkpointing",
                     "check_inputs", "balance_dp_tokens", "shard_single_rank"):
            _check_type("EngineConfig", name, getattr(self, name), (bool,), "a bool")
        _choice("EngineConfig", "pad_mode", self.pad_mode, PAD_MODES)
        _choice("EngineConfig", "fused_kernel_impl", self.fused_kernel_impl, FUSED_KERNEL_IMPLS)
        _choice("EngineConfig", "param_dtype", self.param_dtype, DTYPES)
        _choice("EngineConfig", "reduce_dtype", self.reduce_dtype, DTYPES)
        _choice("EngineConfig", "reshard_policy", self.reshard_policy, RESHARD_POLICIES)
        _choice("EngineConfig", "offload", self.offload, OFFLOAD_MODES)
        if self.max_tokens_per_micro_batch is not None:
            _check_type("EngineConfig", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, (int,),
                        "a positive int or None")
            if self.max_tokens_per_micro_batch < 1:
                raise ConfigFieldError("EngineConfig", "max_tokens_per_micro_batch",
                                       f"expected >= 1 or None, got {self.max_tokens_per_micro_batch}")
        _check_type("EngineConfig", "ulysses_sp_size", self.ulysses_sp_size, (int,), "a positive int")
        if self.ulysses_sp_size < 1:
            raise ConfigFieldError("EngineConfig", "ulysses_sp_size", f"expected >= 1, got {self.ulysses_sp_size}")


@dataclass
class OptimConfig(_FromDict):
    """AdamW and its learning-rate schedule (``constant`` or ``warmup_cosine``).

    Both schedules warm up linearly over ``warmup_steps``; ``warmup_cosine`` then decays to
    ``min_lr_ratio * lr`` at ``total_steps``. ``grad_clip=None`` turns clipping off.
    ``impl`` picks torch's AdamW kernel (``auto``, ``for_loop``, ``foreach``, ``fused``): the
    same update, fewer (and faster) op launches for ``foreach``/``fused``.
    """

    # AdamW moves each weight by about lr per step: above 1 nothing is left to train.
    lr: float = setting(1e-5, doc="learning rate", high=1.0)
    betas: tuple[float, float] = setting((0.9, 0.999), doc="AdamW's betas, two numbers in [0, 1)")
    eps: float = setting(1e-8, doc="AdamW's eps", high=1.0)
    weight_decay: float = setting(0.0, doc="decoupled weight decay")
    grad_clip: float | None = setting(1.0, doc="gradient norm clip; null: no clipping")
    lr_scheduler: str = setting("constant", doc="constant | warmup_cosine")
    warmup_steps: int = setting(0, doc="linear warm-up steps")
    total_steps: int | None = setting(None, doc="null: the phase's optimizer steps (trainer.sft_steps or "
                                                "trainer.rl_steps x updates per rollout)")
    min_lr_ratio: float = setting(0.0, doc="warmup_cosine decays to min_lr_ratio * lr")
    impl: str = setting("auto", doc="AdamW kernel: auto (torch: per-tensor loop on CPU) | for_loop | foreach "
                                    "| fused")

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
            if self.total_steps < 1:  # a constant schedule ignores it, but a negative count is a mistake
                raise ConfigFieldError("OptimConfig", "total_steps", f"expected an int >= 1 or None, got "
                                       f"{self.total_steps}")
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
