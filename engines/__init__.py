"""The shared FSDP engine core: jagged batches, fused log-probs, FSDP2, losses, checkpoints.

The public face (docs/architecture.md)::

    from polyfsdp.engines import (FSDPEngine, EngineConfig, ModelConfig, LoraConfig, OptimConfig,
                                  SFTLoss, PPOLoss, GSPOLoss, ValueLoss, LossInputs, make_jagged)

Names are imported on first use, so ``import polyfsdp.engines.jagged`` stays light.
"""
# Imported first so its guard against torch's device-extension auto-loading runs before torch.
import importlib

import polyfsdp.backends  # noqa: F401

_PUBLIC = {
    "FSDPEngine": "engine",
    "EngineConfig": "config",
    "ModelConfig": "config",
    "LoraConfig": "config",
    "OptimConfig": "config",
    "SFTLoss": "losses",
    "PPOLoss": "losses",
    "GSPOLoss": "losses",
    "ValueLoss": "losses.value",
    "LossInputs": "losses.inputs",
    "make_jagged": "jagged",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Module paths before the move into sub-packages keep working (engines/moved_modules.py).
from polyfsdp.engines.moved_modules import install as _install_moved

MOVED_MODULES = {
    "polyfsdp.engines.batch_checks": "polyfsdp.engines.batch.checks",
    "polyfsdp.engines.checkpoint_background": "polyfsdp.engines.checkpoint.background",
    "polyfsdp.engines.checkpoint_files": "polyfsdp.engines.checkpoint.files",
    "polyfsdp.engines.checkpoint_layout": "polyfsdp.engines.checkpoint.layout",
    "polyfsdp.engines.checkpoint_parts": "polyfsdp.engines.checkpoint.parts",
    "polyfsdp.engines.checkpoint_verdict": "polyfsdp.engines.checkpoint.verdict",
    "polyfsdp.engines.dp_balance": "polyfsdp.engines.batch.dp_balance",
    "polyfsdp.engines.flat_batch": "polyfsdp.engines.batch.flat",
    "polyfsdp.engines.forward_logprobs": "polyfsdp.engines.head.forward",
    "polyfsdp.engines.fused_logprob": "polyfsdp.engines.head.fused",
    "polyfsdp.engines.fused_logprob_compiled": "polyfsdp.engines.head.fused_compiled",
    "polyfsdp.engines.fused_logprob_loss": "polyfsdp.engines.head.fused_loss",
    "polyfsdp.engines.hf_export": "polyfsdp.engines.checkpoint.hf_export",
    "polyfsdp.engines.host_optimizer": "polyfsdp.engines.parallel.host_optimizer",
    "polyfsdp.engines.jagged_checks": "polyfsdp.engines.jagged.checks",
    "polyfsdp.engines.jagged_kernels": "polyfsdp.engines.jagged.kernels",
    "polyfsdp.engines.jagged_left_right": "polyfsdp.engines.jagged.left_right",
    "polyfsdp.engines.labels": "polyfsdp.engines.jagged.labels",
    "polyfsdp.engines.lora": "polyfsdp.engines.model.lora",
    "polyfsdp.engines.loss_aggregation": "polyfsdp.engines.losses.aggregation",
    "polyfsdp.engines.loss_inputs": "polyfsdp.engines.losses.inputs",
    "polyfsdp.engines.micro_batch": "polyfsdp.engines.batch.micro",
    "polyfsdp.engines.model_builder": "polyfsdp.engines.model.builder",
    "polyfsdp.engines.offload": "polyfsdp.engines.parallel.offload",
    "polyfsdp.engines.optim": "polyfsdp.engines.model.optim",
    "polyfsdp.engines.parallelize": "polyfsdp.engines.parallel.fsdp",
    "polyfsdp.engines.ppo_loss": "polyfsdp.engines.losses.ppo",
    "polyfsdp.engines.sequence_parallel": "polyfsdp.engines.parallel.sequence",
    "polyfsdp.engines.ulysses_attention": "polyfsdp.engines.attention.ulysses",
    "polyfsdp.engines.value_head": "polyfsdp.engines.head.value",
    "polyfsdp.engines.value_loss": "polyfsdp.engines.losses.value",
    "polyfsdp.engines.weight_stream": "polyfsdp.engines.model.weight_stream",
}
_install_moved(MOVED_MODULES)
