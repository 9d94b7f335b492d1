"""Fused-op patches shared by gated decoder families (Qwen2, Qwen3, Llama): RMSNorm, rotary, SwiGLU MLP, attention.

These families share module shapes in transformers; a :class:`FamilySpec` names the
family's classes and its one structural difference (per-head q/k norms in Qwen3). A
vision-language family (Qwen2-VL, ...) patches its text decoder only
(``model.model.language_model``): the vision tower's modules are never edited, and the
rotary and attention patches are skipped with their reason (mrope, and an attention config
that is the text sub-config, are not what they reproduce).
Model code is located lazily (only when a model of that type is patched) and checked
for the shape these patches assume, so a transformers change skips a patch with a reason
instead of breaking it.
"""
from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from .edits import EditLog
from .fused_attention import ATTN_NAME, OP_ATTR, register_with_transformers
from .registry import Patch
from .verify import ProbeCase

_PROBE_SEED = 1234
_PROBE_BATCH, _PROBE_LENGTH = 2, 6


@dataclass(frozen=True)
class FamilySpec:
    """Where a family lives in transformers and how its attention differs."""

    family: str
    model_types: tuple[str, ...]
    module: str
    prefix: str
    qk_norm: bool
    # A class whose name is not prefix + suffix (Qwen2-VL's text MLP is Qwen2MLP): suffix -> name.
    class_names: tuple[tuple[str, str], ...] = ()
    # A vision-language family: only the text decoder is patched (module docstring).
    vision_language: bool = False

    def resolve(self, suffix: str) -> tuple[type | None, str | None]:
        """(class, None) for e.g. suffix 'RMSNorm', or (None, reason) when transformers lacks it."""
        try:
            module = importlib.import_module(self.module)
        except Exception as exc:
            return None, f"cannot import {self.module}: {type(exc).__name__}: {exc}"
        name = dict(self.class_names).get(suffix, self.prefix + suffix)
        cls = getattr(module, name, None)
        if cls is None:
            return None, f"{self.module} has no {name} (transformers changed)"
        return cls, None

    def scope(self, model: nn.Module) -> nn.Module:
        """The part of ``model`` this family's patches edit: a vision-language model's text
        decoder, else the whole model."""
        if not self.vision_language:
            return model
        decoder = getattr(getattr(model, "model", None), "language_model", None)
        if decoder is None:
            raise RuntimeError(f"{type(model).__name__} has no model.language_model (transformers changed)")
        return decoder


def _instances(model: nn.Module, cls: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, cls)]


def _forward_source(cls: type) -> str:
    return inspect.getsource(inspect.unwrap(cls.forward))


def _shape_problem(spec: FamilySpec, suffix: str, model: nn.Module, attrs: tuple[str, ...],
                   source_needs: tuple[str, ...], source_forbids: tuple[str, ...] = ()):
    """Return (instances, None) when the model has modules of the family class with the expected
    attributes and forward body, else (None, reason)."""
    cls, reason = spec.resolve(suffix)
    if reason:
        return None, reason
    found = _instances(spec.scope(model), cls)
    if not found:
        return None, f"model has no {cls.__name__} modules"
    missing = [a for a in attrs if not hasattr(found[0], a)]
    if missing:
        return None, f"{cls.__name__} lacks {', '.join(missing)} (transformers changed)"
    try:
        source = _forward_source(cls)
    except (OSError, TypeError) as exc:
        return None, f"cannot read {cls.__name__}.forward: {exc}"
    absent = [s for s in source_needs if s not in source]
    if absent:
        return None, f"{cls.__name__}.forward no longer contains {absent[0]!r} (transformers changed)"
    present = [s for s in source_forbids if s in source]
    if present:
        return None, f"{cls.__name__}.forward now contains {present[0]!r}, which this patch does not reproduce"
    return found, None


def _require(found: tuple[list[nn.Module] | None, str | None]) -> list[nn.Module]:
    """The modules a patch edits, from a ``(modules, reason)`` lookup; its reason raised as an
    error (which rolls the patch back) when there are none to edit."""
    modules, reason = found
    if reason:
        raise RuntimeError(reason)
    return modules


def _bind_fused_forward(edits: EditLog, modules: list[nn.Module], op_attr: str, op: Callable,
                        forward: Callable) -> None:
    """Give each module the fused op (as ``op_attr``) and the forward that calls it."""
    for module in modules:
        edits.set_attr(module, op_attr, op)
        edits.replace_forward(module, forward)


def _param(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


def _generator(device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(_PROBE_SEED)
    return gen


def _randn(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(like.device), device=like.device, dtype=torch.float32).to(like.dtype)


# ---------------------------------------------------------------- RMSNorm
def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    op = self._polyfsdp_rms_norm_op
    weight = self.weight
    if weight.dtype == hidden_states.dtype:
        return op(hidden_states, weight, epsilon=self.variance_epsilon)[0]
    # The fused op needs one dtype; the result keeps transformers' promoted dtype.
    out = op(hidden_states, weight.to(hidden_states.dtype), epsilon=self.variance_epsilon)[0]
    return out.to(torch.promote_types(hidden_states.dtype, weight.dtype))


def _rms_norm_patch(spec: FamilySpec) -> Patch:
    attrs = ("weight", "variance_epsilon")
    needs = ("variance_epsilon", "rsqrt")

    def check(model, ops):
        return _shape_problem(spec, "RMSNorm", model, attrs, needs)[1]

    def apply(model, ops, edits: EditLog):
        norms = _require(_shape_problem(spec, "RMSNorm", model, attrs, needs))
        _bind_fused_forward(edits, norms, "_polyfsdp_rms_norm_op", ops["rms_norm"], _rms_norm_forward)

    def probe(model):
        norms, _ = _shape_problem(spec, "RMSNorm", model, attrs, needs)
        norm = norms[0]
        x = _randn((_PROBE_BATCH, _PROBE_LENGTH, norm.weight.shape[-1]), _param(norm))
        return [ProbeCase(type(norm).__name__, norm, lambda: ((x,), {}))]

    return Patch(f"{spec.family}.rms_norm", spec.model_types, ("rms_norm",), apply, check, probe,
                 "RMSNorm -> fused rms_norm")


# ---------------------------------------------------------------- SwiGLU MLP
def _swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # cat() yields the contiguous [gate | up] layout the fused op splits in half.
    gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
    return self.down_proj(self._polyfsdp_swiglu_op(gate_up, dim=-1))


def _swiglu_patch(spec: FamilySpec) -> Patch:
    attrs = ("gate_proj", "up_proj", "down_proj")
    needs = ("self.act_fn(self.gate_proj(x)) * self.up_proj(x)",)

    def check(model, ops):
        act = getattr(model.config.get_text_config(), "hidden_act", None)
        if act not in ("silu", "swish"):
            return f"hidden_act is {act!r}; the fused swiglu op computes silu"
        return _shape_problem(spec, "MLP", model, attrs, needs)[1]

    def apply(model, ops, edits: EditLog):
        mlps = _require(_shape_problem(spec, "MLP", model, attrs, needs))
        _bind_fused_forward(edits, mlps, "_polyfsdp_swiglu_op", ops["swiglu"], _swiglu_mlp_forward)

    def probe(model):
        mlp = _shape_problem(spec, "MLP", model, attrs, needs)[0][0]
        x = _randn((_PROBE_BATCH, _PROBE_LENGTH, mlp.gate_proj.in_features), _param(mlp))
        return [ProbeCase(type(mlp).__name__, mlp, lambda: ((x,), {}))]

    return Patch(f"{spec.family}.swiglu", spec.model_types, ("swiglu",), apply, check, probe,
                 "gated MLP -> fused swiglu")


# ---------------------------------------------------------------- attention module (rotary) and its probe
_ATTN_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")


def _attention_shape(spec: FamilySpec, model: nn.Module, rotary: bool):
    """(attention modules, None) or (None, reason). The rotary patch re-implements the forward, so it
    needs the whole body it reproduces; the kernel patch only needs the attention-interface dispatch."""
    dispatch = ("ALL_ATTENTION_FUNCTIONS.get_interface(", "self.config._attn_implementation")
    if not rotary:
        return _shape_problem(spec, "Attention", model, _ATTN_ATTRS, dispatch)
    needs = dispatch + ("apply_rotary_pos_emb(query_states, key_states, cos, sin)", "self.o_proj(")
    qk = ("self.q_norm(", "self.k_norm(")
    return _shape_problem(spec, "Attention", model, _ATTN_ATTRS, needs + (qk if spec.qk_norm else ()),
                          () if spec.qk_norm else qk)


def _make_rotary_forward(spec: FamilySpec, eager_fallback: Callable) -> Callable:
    """The family's attention forward, with the two rotary multiplies done by the fused op."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if spec.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        # (B, S, D) -> (B, 1, S, D): the broadcast layout the 4-D rotary op accepts for (B, N, S, D) input.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotary = self._polyfsdp_rotary_op
        query, key = rotary(query, cos, sin), rotary(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_fallback)
        extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
        attn_output, attn_weights = interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **extra, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    return forward


def _rotary_module(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            return module
    return None


def _attention_probe(spec: FamilySpec) -> Callable[[nn.Module], list[ProbeCase]]:
    """Two calls of the first attention module: a right-padded batch and a packed row."""

    def probe(model):
        from transformers.masking_utils import create_causal_mask

        cls, _ = spec.resolve("Attention")
        attn = _instances(model, cls)[0]
        rotary = _rotary_module(model)
        like = _param(attn)
        hidden_size = attn.q_proj.in_features
        padded_x = _randn((_PROBE_BATCH, _PROBE_LENGTH, hidden_size), like)
        padded_pos = torch.arange(_PROBE_LENGTH, device=like.device).expand(_PROBE_BATCH, -1)
        padded_keep = torch.ones(_PROBE_BATCH, _PROBE_LENGTH, dtype=torch.long, device=like.device)
        padded_keep[1, _PROBE_LENGTH // 2:] = 0
        lengths = (2, _PROBE_LENGTH - 2, 3)
        packed_x = _randn((1, sum(lengths), hidden_size), like)
        packed_pos = torch.cat([torch.arange(n, device=like.device) for n in lengths])[None]

        def inputs(x, positions, keep):
            def make():
                # Built per call: the mask format follows the attention implementation selected now.
                mask = create_causal_mask(config=attn.config, inputs_embeds=x, attention_mask=keep,
                                          cache=None, position_ids=positions)
                return (x,), {"position_embeddings": rotary(x, positions), "attention_mask": mask,
                              "position_ids": positions}
            return make

        return [
            ProbeCase(f"{cls.__name__} padded", attn, inputs(padded_x, padded_pos, padded_keep)),
            ProbeCase(f"{cls.__name__} packed", attn, inputs(packed_x, packed_pos, None)),
        ]

    return probe


def _rope_patch(spec: FamilySpec) -> Patch:
    def check(model, ops):
        rotary = _rotary_module(model)
        if rotary is None:
            return "model has no rotary embedding module"
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        if scaling > 1.0:
            return f"rotary attention_scaling {scaling:g} > 1 puts cos/sin outside the [-1, 1] range the fused op takes"
        return _attention_shape(spec, model, rotary=True)[1]

    def apply(model, ops, edits: EditLog):
        attns = _require(_attention_shape(spec, model, rotary=True))
        fallback = getattr(importlib.import_module(spec.module), "eager_attention_forward")
        _bind_fused_forward(edits, attns, "_polyfsdp_rotary_op", ops["rotary_mul"],
                            _make_rotary_forward(spec, fallback))

    return Patch(f"{spec.family}.rope", spec.model_types, ("rotary_mul",), apply, check, _attention_probe(spec),
                 "rotary embedding -> fused rotary_mul")


# ---------------------------------------------------------------- attention kernel
def _attention_patch(spec: FamilySpec) -> Patch:
    def check(model, ops):
        layer_types = getattr(model.config, "layer_types", None) or ()
        if "sliding_attention" in layer_types:
            return "sliding-window layers are not supported by the fused attention patch"
        return _attention_shape(spec, model, rotary=False)[1]

    def apply(model, ops, edits: EditLog):
        attns = _require(_attention_shape(spec, model, rotary=False))
        register_with_transformers()
        # A private config: models built from one shared config object must not switch together.
        shared = model.config
        private = copy.deepcopy(shared)
        private._attn_implementation = ATTN_NAME
        for module in model.modules():
            if vars(module).get("config") is shared:
                edits.set_attr(module, "config", private)
        for attn in attns:
            edits.set_attr(attn, OP_ATTR, ops["fusion_attention"])

    return Patch(f"{spec.family}.attention", spec.model_types, ("fusion_attention",), apply, check,
                 _attention_probe(spec), "attention -> fused fusion_attention (BSND padded, TND packed)")


def _not_for_vision_language(patch: Patch, reason: str) -> Patch:
    """``patch`` with a readiness check that always skips it, saying why."""
    return replace(patch, check=lambda model, ops: reason)


def build_patches(spec: FamilySpec) -> list[Patch]:
    """The four patches of one family, in the order they are applied."""
    rope, attention = _rope_patch(spec), _attention_patch(spec)
    if spec.vision_language:
        rope = _not_for_vision_language(rope, "mrope (three position rows) is not the rotary_mul this patch "
                                              "reproduces; transformers' rotary runs")
        attention = _not_for_vision_language(attention, "the fused attention patch does not support "
                                                        "vision-language models yet; transformers' attention runs")
    return [_rms_norm_patch(spec), rope, _swiglu_patch(spec), attention]
