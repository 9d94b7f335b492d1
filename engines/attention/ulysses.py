"""DeepSpeed-Ulysses attention: sequence-sharded q/k/v -> head-sharded, whole-sequence
attention, and back (docs/architecture.md, "Sequence parallelism").

:func:`install_ulysses` points every attention config of one model at a wrapper registered
as ``polyfsdp_ulysses:<inner>``. The wrapper runs the model's own attention function
(``<inner>``) unchanged unless the forward carries an :class:`UlyssesContext` under the
``polyfsdp_ulysses`` keyword (the engine's sequence-parallel forward): then each rank holds
``c`` consecutive positions of every row, and two all-to-alls (through
``backends.distributed.all_to_all``) give it all positions for ``heads / sp`` heads while the
inner function runs with the GLOBAL sequence boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from polyfsdp.backends.distributed import all_to_all
from polyfsdp.patches.fused_attention import ATTN_NAME as FUSION_ATTENTION

from . import VARLEN_SDPA

SP_KWARG = "polyfsdp_ulysses"
PREFIX = "polyfsdp_ulysses:"
# Inner functions that take the sequence boundaries as keywords (cu_seq_lens / host copy)
# and need no mask: the mask transformers builds from a shard's local positions would be wrong.
INNER_OK = (VARLEN_SDPA, FUSION_ATTENTION, "flash_attention_2", "flash_attention_3")


@dataclass
class UlyssesContext:
    """One sequence-parallel forward: the group, its size, and the keywords (global
    ``cu_seq_lens``, host boundaries, max lengths) the inner attention function gets."""

    group: object
    size: int
    attention_kwargs: dict = field(default_factory=dict)


def heads_from_sequence(x: torch.Tensor, ctx: UlyssesContext) -> torch.Tensor:
    """``(B, H, c, D)`` (this rank's positions, all heads) -> ``(B, H/sp, sp*c, D)``."""
    b, h, c, d = x.shape
    send = x.reshape(b, ctx.size, h // ctx.size, c, d).transpose(0, 1)  # head group j -> rank j
    recv = all_to_all(send, ctx.group)  # chunk i: rank i's positions
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // ctx.size, ctx.size * c, d)


def sequence_from_heads(out: torch.Tensor, ctx: UlyssesContext) -> torch.Tensor:
    """``(B, sp*c, H/sp, D)`` (attention output layout) -> ``(B, c, H, D)``."""
    b, s, h, d = out.shape
    c = s // ctx.size
    send = out.reshape(b, ctx.size, c, h, d).transpose(0, 1)  # positions of rank i -> rank i
    recv = all_to_all(send, ctx.group)  # chunk j: head group j
    return recv.permute(1, 2, 0, 3, 4).reshape(b, c, ctx.size * h, d)


def ulysses_attention(inner, module, query, key, value, attention_mask, **kwargs):
    """Attention with q/k/v ``(B, H, c, D)`` sharded by position over the context's group."""
    ctx: UlyssesContext | None = kwargs.pop(SP_KWARG, None)
    if ctx is None or ctx.size == 1:
        return inner(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:
        raise ValueError(f"{PREFIX} got an attention mask; sequence-parallel rows are causal or packed "
                         f"and must reach attention without one")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % ctx.size:
        # GQA with fewer key/value heads than ranks: give every query head its own copy.
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    q, k, v = (heads_from_sequence(t, ctx) for t in (query, key, value))
    kwargs.update(ctx.attention_kwargs)
    kwargs["position_ids"] = None  # the local positions describe this shard, not the whole rows
    out, _ = inner(module, q, k, v, None, **kwargs)
    return sequence_from_heads(out, ctx), None


def _register(inner_name: str) -> str:
    name = PREFIX + inner_name

    def forward(module, query, key, value, attention_mask, **kwargs):
        return ulysses_attention(ALL_ATTENTION_FUNCTIONS[inner_name], module, query, key, value, attention_mask,
                                 **kwargs)

    AttentionInterface.register(name, forward)
    if inner_name in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner_name])
    return name


def check_heads(config: PretrainedConfig, sp_size: int) -> None:
    """Refuse head counts Ulysses cannot split, naming them."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or heads % sp_size:
        raise ValueError(f"ulysses_sp_size={sp_size} must divide the number of attention heads "
                         f"(num_attention_heads={heads}, num_key_value_heads={kv_heads})")


def install_ulysses(model: torch.nn.Module, sp_size: int) -> None:
    """Route every attention config of ``model`` (the model's and any private ones a patch
    gave its modules) through the Ulysses wrapper of its current implementation."""
    check_heads(model.config, sp_size)
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs.setdefault(id(config), config)
    for config in configs.values():
        inner = config._attn_implementation
        if inner.startswith(PREFIX):
            continue
        if inner not in INNER_OK:
            raise ValueError(f"ulysses_sp_size={sp_size} needs an attention implementation that takes sequence "
                             f"boundaries ({', '.join(INNER_OK)}); this model uses {inner!r}")
        config._attn_implementation = _register(inner)
