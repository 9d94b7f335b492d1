"""Independent LoRA references for the tests: adapters merged by hand (W + alpha/r * B @ A),
never through peft's merge or polyfsdp's code."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

BASE = ".base_layer."


def merged_by_hand(state: dict, rank: int, alpha: float, adapter: str = "default") -> dict:
    """A plain HF state dict from a LoRA model's full state dict: every ``x.base_layer.weight``
    becomes ``x.weight + alpha / rank * lora_B @ lora_A``, adapter tensors are dropped."""
    scale = alpha / rank
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if BASE not in key:
            out[key] = value
            continue
        prefix, _, leaf = key.partition(BASE)
        if leaf == "weight":
            a = state[f"{prefix}.lora_A.{adapter}.weight"].double()
            b = state[f"{prefix}.lora_B.{adapter}.weight"].double()
            value = (value.double() + scale * (b @ a)).to(value.dtype)
        out[f"{prefix}.{leaf}"] = value
    return out


def base_only(state: dict) -> dict:
    """A plain HF state dict of the base weights alone (adapters ignored)."""
    return {key.replace(BASE, "."): value for key, value in state.items() if ".lora_" not in key}


def randomize_adapters(module, seed: int = 0, std: float = 0.2) -> None:
    """Give every adapter matrix random values (peft starts lora_B at zero, which would make
    the adapters invisible). Draws each whole matrix, so every world size gets the same
    adapters, and writes the rank's shard of it in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_" in name:
                values = torch.randn(param.shape, generator=g) * std
                if isinstance(param, DTensor):
                    values = distribute_tensor(values, param.device_mesh, param.placements).to_local()
                (param.to_local() if isinstance(param, DTensor) else param).copy_(values)
