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
