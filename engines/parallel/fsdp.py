"""Every FSDP2 decision in one place, torchtitan style: activation checkpointing, then
``fully_shard`` on each decoder layer and the root, mixed precision, gradient reduction,
reshard policy. The engine calls :func:`parallelize_model` once, between building the model
and creating the optimizer."""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from ..config import TORCH_DTYPES, EngineConfig

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers``), or of a
    vision-language model's text decoder (``model.model.language_model.layers``)."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        layers = getattr(getattr(body, "language_model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers "
                         f"(a decoder-only Hugging Face causal LM) or model.model.language_model.layers "
                         f"(a vision-language model)")
    return list(layers)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """A vision-language model's vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``model.model.visual``,
    its blocks and the merger that projects into the decoder's width), or None for a text model."""
    return getattr(getattr(model, "model", None), "visual", None)


def vision_units(model: nn.Module) -> list[nn.Module]:
    """The vision tower's FSDP2 units, innermost first: each block, each merger (the projector,
    and Qwen3-VL's deepstack mergers), then the tower itself (patch and position embeddings)."""
    tower = vision_tower(model)
    if tower is None:
        return []
    mergers = [m for name, m in tower.named_children() if name == "merger"]
    mergers += list(getattr(tower, "deepstack_merger_list", None) or [])
    return [*getattr(tower, "blocks", []), *mergers, tower]


def reshard_after_forward(policy: str) -> tuple[bool, bool | None]:
    """``(layers, root)`` reshard-after-forward flags for a policy name.

    ``default``: layers free their gathered weights after forward (memory), the root gets
    FSDP2's automatic choice (None: kept, since backward needs embeddings and head at once).
    ``always``: everything reshards (least memory). ``never``: nothing does (fastest, most memory).
    """
    flags = {"default": (True, None), "always": (True, True), "never": (False, False)}
    if policy not in flags:
        raise ValueError(f"reshard_policy: got {policy!r}; allowed values: {', '.join(flags)}")
    return flags[policy]


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing per decoder layer (the API was renamed in transformers 5),
    and per vision block unless the tower is frozen (``freeze_vision``, see below)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tower = vision_tower(model)
    blocks = [] if tower is None else list(getattr(tower, "blocks", []))
    if not blocks or any(p.requires_grad for block in blocks for p in block.parameters()):
        return
    # transformers also makes each input embedding's output require grad (for reentrant checkpoints),
    # the tower's patch embedding's too: a frozen tower's blocks would then keep their inputs and run
    # a backward (recomputing each block) for a gradient nothing reads. Without it they record nothing.
    try:
        embedding = tower.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # Qwen3-VL's tower names none (and gets no hook)
        embedding = None
    for handle in getattr(model, "_require_grads_hooks", None) or []:
        if embedding is not None and handle.id in embedding._forward_hooks:
            handle.remove()
    for block in blocks:
        block.gradient_checkpointing = False


def needs_sharding(model: nn.Module, mesh: DeviceMesh, config: EngineConfig) -> bool:
    """Whether to apply ``fully_shard`` (CPU offload always needs it): always with several
    ranks or ``shard_single_rank``; on one rank only when the mixed-precision casts (param_dtype, reduce_dtype) would
    change a parameter's dtype. Otherwise FSDP2 computes exactly what the plain model does
    and only adds hooks and DTensor dispatch to every forward, backward and AdamW step."""
    if mesh.size() > 1 or config.shard_single_rank:
        return True
    wanted = {TORCH_DTYPES[config.param_dtype], TORCH_DTYPES[config.reduce_dtype]}
    return any({p.dtype} != wanted for p in model.parameters() if p.is_floating_point())


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2's per-backward gradient-sync switch; a plain (one-rank) model has none to skip."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def parallelize_model(model: nn.Module, mesh: DeviceMesh, config: EngineConfig,
                      forward_methods: tuple[str, ...] = (), offload_policy=None) -> nn.Module:
    """Checkpoint activations (if asked), shard every decoder layer and then the root on
    ``mesh`` with the config's mixed precision, and make gradients SUM over ranks.
    ``forward_methods`` of the root also gather its parameters (e.g. the fused log-prob head);
    ``offload_policy`` (engines/parallel/offload.py) keeps shards on the host. A one-rank world that
    needs no casts and no offload stays the plain model (:func:`needs_sharding`)."""
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if offload_policy is None and not needs_sharding(model, mesh, config):
        logger.debug("one rank, no mixed-precision casts: the model runs unsharded (no FSDP2)")
        return model
    # Inputs are cast by the caller where needed; casting here would round per-sample
    # temperatures to the parameter dtype.
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[config.param_dtype],
                              reduce_dtype=TORCH_DTYPES[config.reduce_dtype], cast_forward_inputs=False)
    layer_reshard, root_reshard = reshard_after_forward(config.reshard_policy)
    offload = {} if offload_policy is None else {"offload_policy": offload_policy}
    layers = decoder_layers(model)
    # A vision tower is sharded like the decoder: every block, the mergers, then the tower, each
    # unit gathered only while it runs (engines/model/vision.py keeps every rank running it).
    for layer in [*vision_units(model), *layers]:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=layer_reshard, **offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard, **offload)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    # Losses are normalised by GLOBAL counts (engines/losses/aggregation.py), so rank gradients must be
    # summed, not averaged. Plain SUM collectives also avoid PREMUL_SUM, which gloo lacks.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    logger.debug("fully_shard applied to %d layers + root on a %d-rank mesh (reshard %s)",
                 len(layers), mesh.size(), config.reshard_policy)
    return model


@contextmanager
def gathered(model: nn.Module, policy: str):
    """Run the block with every FSDP2 parameter group all-gathered once and kept (no
    per-forward gather or reshard), then reshard and restore ``policy``'s flags. For
    generation: one gather per rollout instead of one per layer per decoding step; the
    cost is the full (unsharded) parameters held on every rank meanwhile. A plain
    (unsharded) model is already whole: nothing to do."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    layer_reshard, root_reshard = reshard_after_forward(policy)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield model
    finally:
        for module in modules:
            # FSDP2's automatic root choice (None) keeps the root gathered after forward.
            flag = bool(root_reshard) if module is model else layer_reshard
            module.set_reshard_after_forward(flag, recurse=False)
            module.reshard()


def gather_fits(model: nn.Module, backend) -> bool:
    """Whether holding ``model``'s full parameters on this rank fits the device's free memory
    (with 20% to spare); True when the backend cannot tell (CPU)."""
    free = backend.free_memory_bytes()
    if free is None:
        return True
    extra = sum(p.numel() * p.element_size() for p in model.parameters())
    extra -= sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else 0 for p in model.parameters())
    return extra * 1.2 <= free
