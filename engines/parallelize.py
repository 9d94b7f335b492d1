"""FSDP2 wrapping, torchtitan style: each decoder layer, then the root, in one function."""
from __future__ import annotations

import logging

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from .config import EngineConfig
from .model_builder import torch_dtype

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers``)."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers "
                         f"(a decoder-only Hugging Face causal LM)")
    return list(layers)


def parallelize_model(model: nn.Module, mesh: DeviceMesh, config: EngineConfig,
                      forward_methods: tuple[str, ...] = ()) -> nn.Module:
    """Apply ``fully_shard`` to every decoder layer and then the root on ``mesh`` with the
    config's mixed-precision policy; ``forward_methods`` of the root also unshard its
    parameters (e.g. the fused log-prob head)."""
    # Inputs are cast by the caller where needed; casting here would round per-sample
    # temperatures to the parameter dtype.
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(config.param_dtype),
                              reduce_dtype=torch_dtype(config.reduce_dtype), cast_forward_inputs=False)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=config.reshard_after_forward)
    # None = FSDP2's automatic choice: the root keeps its parameters (embeddings, head) gathered
    # after forward, since backward would all-gather them again at once.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=None if config.reshard_after_forward else False)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    logger.debug("fully_shard applied to %d layers + root on a %d-rank mesh", len(decoder_layers(model)), mesh.size())
    return model
