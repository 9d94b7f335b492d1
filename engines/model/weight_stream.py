"""The model's full weights, streamed from its FSDP2 shards in Hugging Face checkpoint names,
for a rollout engine that holds its own copy (trainer/rollout/vllm.py).

Collective: every rank must iterate the stream to the end, in the same order (each sharded
parameter is one all-gather that all ranks join). Names are the checkpoint's: wrapper
prefixes (activation checkpointing, torch.compile) are dropped, and a LoRA layer yields its
merged weight ``W + scaling * B @ A`` under the base name (the adapters themselves are not
yielded), so the receiver sees a plain model. Parameters come grouped by module, a decoder
layer never split between two buckets: a receiver that fuses a layer's projections (vLLM's
``qkv_proj``) must get all of them in one load.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
_LAYER = re.compile(r"^(.*?layers\.\d+)\.")
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def checkpoint_name(name: str) -> str:
    """``name`` without the wrapper modules' prefixes."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (all-gathered when sharded), detached."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers by module name (empty without adapters)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "lora_A") and hasattr(m, "scaling")}


def _merged_weight(layer, base: torch.Tensor) -> torch.Tensor:
    """``base + sum over active adapters of scaling * B @ A`` (float32 math, base's dtype)."""
    merged = base.float()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a, b = _full(layer.lora_A[adapter].weight).float(), _full(layer.lora_B[adapter].weight).float()
        merged = merged + layer.scaling[adapter] * (b @ a)
    return merged.to(base.dtype)


def tied_output_name(model: torch.nn.Module) -> str | None:
    """The checkpoint name of the output embedding when it is tied to the input one (one
    parameter, so :func:`full_weights` yields it once), else None."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or inputs is None or outputs.weight is not inputs.weight:
        return None
    return next(checkpoint_name(f"{name}.weight") for name, m in model.named_modules() if m is outputs)


def full_weights(model: torch.nn.Module, untie: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, full tensor)`` of every parameter of ``model``, in module order;
    with ``untie`` a tied output embedding comes last under its own name too (for a receiver
    holding it as a separate weight)."""
    yield from _parameters(model)
    tied = tied_output_name(model) if untie else None
    if tied is not None:
        yield tied, _full(model.get_input_embeddings().weight)


def _parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    lora = _lora_layers(model)
    for name, param in model.named_parameters():
        owner = next((o for o in lora if name.startswith(o + ".")), None)
        if owner is None:
            yield checkpoint_name(name), _full(param)
            continue
        rest = name[len(owner) + 1:]
        if rest.split(".")[0] in _LORA_PARTS:
            continue  # folded into the base weight below
        if not rest.startswith("base_layer."):
            raise ValueError(f"weight stream: unexpected parameter {name!r} inside a LoRA layer")
        tensor = _full(param)
        if rest == "base_layer.weight":
            tensor = _merged_weight(lora[owner], tensor)
        yield checkpoint_name(f"{owner}.{rest[len('base_layer.'):]}"), tensor


def _group(name: str) -> str:
    """The unit a bucket never splits: the decoder layer, else the owning module."""
    match = _LAYER.match(name)
    return match.group(1) if match else name.rpartition(".")[0]


def weight_buckets(model: torch.nn.Module, bucket_bytes: int,
                   untie: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:func:`full_weights` in buckets of whole groups (decoder layers, other modules), each
    closed once it holds ``bucket_bytes`` or more; at most one bucket is alive at a time."""
    bucket, size, group = [], 0, None
    for name, tensor in full_weights(model, untie):
        here = _group(name)
        if bucket and here != group and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        group = here
    if bucket:
        yield bucket
