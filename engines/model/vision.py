"""A vision-language model's vision tower inside the engine (docs/vision-language.md).

Installed per instance by ``build_model`` (the model's classes are never edited):

- ``freeze_vision``: the tower's patch and position embeddings and blocks get
  ``requires_grad=False`` (no gradients, and the optimizer, built over trainable parameters,
  never sees them); the mergers, the projection into the decoder's width, keep training.
- The text keywords stay out of the tower: transformers hands the model's ``**kwargs`` to the
  vision tower too, and the packed text row's varlen keywords (``cu_seq_lens_q``, the host
  boundaries) would make the tower's attention treat its image patches as the text's
  sequences, causal and cut at the wrong places.
- Every rank runs the tower on every forward: under FSDP2 with several ranks, the tower's
  units all-gather their shards when they run, so a rank whose micro-batch holds no image
  (text-only rows, a placeholder) runs it on a one-token dummy image whose features enter the
  embeddings times zero; the collectives pair up and the numbers do not change.
"""
from __future__ import annotations

import re
import types
import warnings

import torch
from torch.distributed.fsdp import FSDPModule

from polyfsdp.backends.base import HOST_CU_SEQ_LENS

from ..parallel.fsdp import decoder_layers, vision_tower, vision_units

# Keywords that describe the packed text row, never the image patches.
TEXT_ROW_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", HOST_CU_SEQ_LENS)


def is_vision_language(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a vision tower the engine drives."""
    return vision_tower(model) is not None


def freeze_vision(model: torch.nn.Module) -> list[str]:
    """Freeze the tower but its mergers; returns the frozen parameters' names (within the tower)."""
    frozen = []
    for name, param in vision_tower(model).named_parameters():
        if "merger" not in name:
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def vision_is_frozen(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a vision tower that :func:`freeze_vision` froze."""
    tower = vision_tower(model)
    return tower is not None and not any(p.requires_grad for name, p in tower.named_parameters()
                                         if "merger" not in name)


def _matrix_elements(modules) -> int:
    """Elements of the weights a position multiplies (2-D and up: linears, the patch convolution)."""
    return sum(p.numel() for m in modules for p in m.parameters() if p.dim() >= 2)


def patch_cost(model: torch.nn.Module) -> float:
    """What one image patch costs the vision tower, in decoder tokens (0 for a text model): the
    multiply-adds of the tower's weights a patch passes through (the patch embedding, every block,
    the mergers over their merge^2 patches) over those of the decoder layers' a token passes
    through; attention's score products are left out on both sides. A frozen tower's share is a
    third: its backward stops at the mergers, while the decoder's backward costs twice its forward
    (no-grad passes of a frozen tower are weighed a third of theirs). Qwen2-VL-7B: 0.098, so an
    image token (4 patches) weighs 1.39 text tokens (1.13 with the tower frozen)."""
    tower = vision_tower(model)
    if tower is None:
        return 0.0
    blocks = list(tower.blocks)
    mergers = [m for m in vision_units(model)[:-1] if all(m is not b for b in blocks)]  # the last unit: the tower
    per_patch = _matrix_elements([tower.patch_embed, *blocks]) + \
        _matrix_elements(mergers) / tower.config.spatial_merge_size ** 2
    cost = per_patch / _matrix_elements(decoder_layers(model))
    return cost / 3 if vision_is_frozen(model) else cost


def _text_keywords_dropped(tower: torch.nn.Module) -> None:
    inner = tower.forward

    def forward(*args, **kwargs):
        for key in TEXT_ROW_KEYWORDS:
            kwargs.pop(key, None)
        return inner(*args, **kwargs)

    tower.forward = forward


def _dummy_image(tower: torch.nn.Module, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes: one merge block of patches (one image token)."""
    config = tower.config
    merge = config.spatial_merge_size
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return torch.zeros(merge * merge, width, device=device, dtype=dtype), grid


def _zero_features(output) -> torch.Tensor:
    """Zero times the sum of every floating tensor the tower returned (pooled features and,
    for Qwen3-VL, the deepstack features): a graph edge to each weight that ran, value 0."""
    tensors = []
    for value in (output.values() if hasattr(output, "values") else [output]):
        items = value if isinstance(value, (list, tuple)) else [value]
        tensors += [t for t in items if torch.is_tensor(t) and t.is_floating_point()]
    return sum(t.sum() for t in tensors) * 0.0


def _keep_tower_running(body: torch.nn.Module, tower: torch.nn.Module) -> None:
    inner = body.forward

    def forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        # Only with explicit positions: without input_ids transformers would reuse the mrope
        # offsets of an earlier call (its rope_deltas) to place the tokens.
        if kwargs.get("pixel_values") is None and ids is not None and kwargs.get("position_ids") is not None \
                and isinstance(tower, FSDPModule):
            embeds = self.get_input_embeddings()(kwargs.pop("input_ids"))
            pixels, grid = _dummy_image(tower, embeds.device, embeds.dtype)
            kwargs["inputs_embeds"] = embeds + _zero_features(tower(pixels, grid_thw=grid)).to(embeds.dtype)
        return inner(*args, **kwargs)

    body.forward = types.MethodType(forward, body)


def install_vision(model: torch.nn.Module, freeze: bool) -> list[str]:
    """Set up ``model``'s vision tower for the engine (module docstring); returns the names of
    the parameters ``freeze`` froze. A model without a tower refuses ``freeze``."""
    tower = vision_tower(model)
    if tower is None:
        if freeze:
            raise ValueError(f"ModelConfig.freeze_vision: {type(model).__name__} has no vision tower "
                             f"(model.model.visual) to freeze")
        return []
    _text_keywords_dropped(tower)
    _keep_tower_running(model.model, tower)
    # The model's output carries the tower's per-image features, views of one split, which
    # nothing in the engine reads or changes in place; FSDP2 warns about views in a sharded
    # root's output on every forward. Silenced for this model class only.
    warnings.filterwarnings("ignore", category=UserWarning, message=rf"FSDP2-wrapped module "
                            rf"\(FSDP{re.escape(type(model).__name__)}\) returned a view tensor")
    return freeze_vision(model) if freeze else []
