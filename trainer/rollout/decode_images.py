"""Prompts with images in the decoding loop (trainer/rollout/decode.py; docs/vision-language.md).

A Qwen2-VL-style model rotates by three position rows (temporal, height, width) that jump inside
an image. The prefill takes the pixel inputs and, as Hugging Face ``generate`` builds them, four
position rows: the text positions (what transformers builds attention masks from) and the
model's own ``get_rope_index`` rows for the left-padded prompts. Each row's ``rope delta`` (its
largest rotary position + 1 minus its real prompt length) then carries the decoding steps on:
a new token at text position ``p`` sits at ``p + delta`` on all three rows, as in ``generate``.
"""
from __future__ import annotations

import torch


def _holds_images(item) -> bool:
    return item is not None and getattr(item, "pixel_values", None) is not None


class PromptImages:
    """The images of a left-padded decoding batch: ``images`` holds, per row, its prompt's
    Example (anything with ``pixel_values (P, D)`` and ``image_grid_thw (I, 3)``) or None."""

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, images: list) -> None:
        if len(images) != ids.shape[0]:
            raise ValueError(f"decode: images for {len(images)} rows, but {ids.shape[0]} prompts")
        config = model.config
        self.device = ids.device
        self.images = list(images)
        dtype = next(model.parameters()).dtype
        self.pixels = [x.pixel_values.to(self.device, dtype) if _holds_images(x) else None for x in images]
        self.grids = [x.image_grid_thw.long().to(self.device) if _holds_images(x) else None for x in images]
        types = (ids == config.image_token_id).to(torch.int)
        grids = [g for g in self.grids if g is not None]
        rope, self.deltas = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=torch.cat(grids),
                                                       attention_mask=mask)
        text = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        self.positions = torch.cat([text[None], rope.to(text.dtype)], dim=0)  # (4, B, width)
        self.deltas = self.deltas.to(self.device).long().view(-1, 1)

    @staticmethod
    def of(model, ids: torch.Tensor, mask: torch.Tensor, images: list | None) -> "PromptImages | None":
        """For a batch where some prompt holds images, else None (a text batch decodes as before)."""
        if images is None or not any(_holds_images(x) for x in images):
            return None
        return PromptImages(model, ids, mask, images)

    def row_keys(self) -> torch.Tensor:
        """(B,) ids that tell which rows' images are the same objects: rows sharing a prompt (a
        GRPO group) share one prefill only when their images are the same too."""
        known: dict[int, int] = {}
        keys = [known.setdefault(id(p), len(known) + 1) if p is not None else 0 for p in self.pixels]
        return torch.tensor(keys, dtype=torch.long, device=self.device)

    def prefill_inputs(self, rows: torch.Tensor | None) -> dict:
        """The prefill's position and image keywords for rows ``rows`` (None: all)."""
        picked = range(len(self.pixels)) if rows is None else rows.tolist()
        pixels = [self.pixels[i] for i in picked if self.pixels[i] is not None]
        grids = [self.grids[i] for i in picked if self.grids[i] is not None]
        positions = self.positions if rows is None else self.positions[:, rows]
        if not pixels:  # the rows picked hold no image
            return {"position_ids": positions}
        return {"position_ids": positions, "pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)}

    @staticmethod
    def step_positions(next_position: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """A decoding step's (3, B, 1) rotary positions: text position plus the row's delta."""
        return (next_position + deltas)[None].expand(3, -1, -1)


def generate_image_inputs(model, ids: torch.Tensor, images: list | None) -> dict:
    """Hugging Face ``generate``'s image keywords for left-padded prompts ``ids`` (none when no
    row holds images): the rows' pixel inputs in row order and the token types it builds the
    mrope positions from."""
    if images is None or not any(_holds_images(x) for x in images):
        return {}
    dtype = next(model.parameters()).dtype
    held = [x for x in images if _holds_images(x)]
    return {"pixel_values": torch.cat([x.pixel_values for x in held]).to(ids.device, dtype),
            "image_grid_thw": torch.cat([x.image_grid_thw.long() for x in held]).to(ids.device),
            "mm_token_type_ids": (ids == model.config.image_token_id).to(torch.int)}
