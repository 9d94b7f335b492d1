"""LoRA adapters through peft, on the Hugging Face model the engine shards.

peft injects its LoRA layers into the model in place (``q_proj`` becomes a ``lora.Linear``
holding ``base_layer``, ``lora_A``, ``lora_B``) and freezes every other parameter; the
engine keeps sharding the plain causal LM, so FSDP2, the fused head and the mode matrix
are unchanged, and the optimizer (built over ``requires_grad`` parameters) only ever sees
the adapters. The reference policy for KL is the same model with the adapters switched
off (:func:`adapters_disabled`), not a second model. Exporting a LoRA model (merged weights
or peft's adapter directory) is ``hf_export.export_hf``'s, the path full models take too.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from ..config import LORA_ALL_LINEAR, LoraConfig
from .vision import freeze_vision, vision_is_frozen

INSTALL_HINT = 'pip install -e ".[lora]"'


def require_peft():
    """peft, or one ImportError line saying how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError(f"ModelConfig.lora.rank > 0 needs peft, which is not installed ({exc}); "
                          f"{INSTALL_HINT}") from None
    return peft


def peft_lora_config(config: LoraConfig):
    """peft's LoraConfig for ours (causal LM; the LM head is never a target)."""
    peft = require_peft()
    targets = LORA_ALL_LINEAR if config.target_modules == LORA_ALL_LINEAR else list(config.target_modules)
    return peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                           target_modules=targets, task_type="CAUSAL_LM", bias="none")


GRADIENT_CHECKPOINTING_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"
# Added to the model seed for the adapters' draws: a stream apart from the base weights'.
ADAPTER_SEED_OFFSET = 0x10_7A


def _peft_model(model: torch.nn.Module, config: LoraConfig):
    """peft's ``get_peft_model`` over ``model``. PeftModel's constructor reads transformers'
    deprecated ``is_gradient_checkpointing`` (now ``is_activation_checkpointing``): that one
    FutureWarning, from inside peft, is ignored for this call only; every other warning shows."""
    peft = require_peft()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
        return peft.get_peft_model(model, peft_lora_config(config))


def add_adapters(model: torch.nn.Module, config: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` in place, freeze the rest, return the same model.

    The adapters' initial matrices are drawn from the host generator (the engine builds on the
    host), forked and seeded from ``seed`` (``ModelConfig.seed``): the same seed gives the same
    adapters in every process and every phase, and the caller's generator neither decides nor
    advances. Adapters are kept in float32 whatever the base dtype (``ModelConfig.dtype='bfloat16'`` keeps the frozen
    base in bf16). A target that matches nothing raises peft's error.
    """
    base_dtype = next(model.parameters()).dtype
    tower_frozen = vision_is_frozen(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + ADAPTER_SEED_OFFSET)
        wrapped = _peft_model(model, config)
    inner = wrapped.get_base_model()
    if inner is not model:
        raise RuntimeError("peft returned a different model object; expected in-place injection")
    if tower_frozen:
        # freeze_vision holds for the adapters peft put on the tower's linears too: they stay at
        # their initial value (B = 0, the identity), so exports and checkpoints need no exception.
        freeze_vision(model)
    # peft upcasts adapters of a half-precision base already; this keeps that a guarantee.
    for param in model.parameters():
        if param.requires_grad and base_dtype != torch.float32:
            param.data = param.data.float()
    return model


def adapter_layers(model: torch.nn.Module) -> list:
    """peft's tuner layers (LoRA-wrapped linears) of ``model``; empty without LoRA."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run the block with every adapter off (the frozen base model); restored afterwards.
    A no-op for a model without adapters."""
    layers = adapter_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters the optimizer trains."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def plain_model_with_adapters(hf_config, config: LoraConfig, state: dict, dtype: torch.dtype | None = None):
    """A fresh, unsharded peft model on the CPU holding ``state`` (the engine's full state dict,
    keys as in the adapted model). Returns peft's wrapper (for ``merge_and_unload`` or
    ``save_pretrained``)."""
    from .builder import auto_class_for  # a vision-language model: its image-text-to-text class

    model = auto_class_for(hf_config).from_config(hf_config)
    wrapped = _peft_model(model, config)
    result = wrapped.get_base_model().load_state_dict(state, strict=False)
    tied = getattr(hf_config, "tie_word_embeddings", False)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(f"LoRA state does not fit the model: missing {missing}, unexpected {result.unexpected_keys}")
    if dtype is not None:
        wrapped.to(dtype)
    return wrapped.eval()


class AdaptersOff:
    """An engine seen with its LoRA adapters off: the frozen base model as the RL phase's KL
    reference, without building a second model. Only inference is offered."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def infer_batch(self, batch, **kwargs):
        """The engine's ``infer_batch`` with ``adapters=False``."""
        return self.engine.infer_batch(batch, adapters=False, **kwargs)
