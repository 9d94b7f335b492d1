"""A batch's images (docs/vision-language.md): per-sequence pixel inputs and mrope positions.

The caller passes two per-sequence jagged fields beside ``input_ids`` (in either pad mode):
``pixel_values`` ``(B, j, D)``, each sequence's images' patch rows concatenated in the order
its image tokens appear (zero rows for a text-only sequence), and ``image_grid_thw``
``(B, j, 3)``, one ``(t, h, w)`` patch grid per image of that sequence, as the model's image
processor returns them. :class:`ImageInputs` keeps them flat, with host counts of images per
sequence and patches per image, so that selecting sequences (micro-batches, DP balance) takes
each sequence's images along without a device read.

Positions: Qwen2-VL-style models rotate by three position rows (temporal, height, width),
which jump inside an image. Packed rows need them per sequence, restarting at every packed
boundary, so :func:`mrope_positions` asks the model's own ``get_rope_index`` about each
sequence alone and concatenates.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")


@dataclass
class ImageInputs:
    """``pixel_values (P, D)`` and ``grid_thw (I, 3)`` of a batch's images in sequence order;
    host lists ``images_per_seq`` (B) and ``patches`` (rows of each image: t * h * w)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    images_per_seq: list[int]
    patches: list[int]

    @property
    def num_images(self) -> int:
        """Images in the batch."""
        return len(self.patches)

    def _image_bounds(self) -> tuple[list[int], list[int]]:
        """First image of each sequence (B+1) and first patch row of each image (I+1)."""
        first_image = [0, *itertools.accumulate(self.images_per_seq)]
        first_row = [0, *itertools.accumulate(self.patches)]
        return first_image, first_row

    def patches_per_seq(self) -> list[int]:
        """Patch rows of each sequence's images (the tower's work on it)."""
        first_image, first_row = self._image_bounds()
        return [first_row[first_image[s + 1]] - first_row[first_image[s]] for s in range(len(self.images_per_seq))]

    def grids(self, seq: int) -> torch.Tensor:
        """The ``(n, 3)`` grids of sequence ``seq``'s images."""
        first_image, _ = self._image_bounds()
        return self.grid_thw[first_image[seq]:first_image[seq + 1]]

    def select(self, seq_ids: list[int]) -> "ImageInputs":
        """The images of sequences ``seq_ids``, in that order."""
        first_image, first_row = self._image_bounds()
        images = [i for s in seq_ids for i in range(first_image[s], first_image[s + 1])]
        rows = [r for i in images for r in range(first_row[i], first_row[i + 1])]
        device = self.grid_thw.device
        return ImageInputs(self.pixel_values[torch.tensor(rows, dtype=torch.long, device=device)],
                           self.grid_thw[torch.tensor(images, dtype=torch.long, device=device)],
                           [self.images_per_seq[s] for s in seq_ids], [self.patches[i] for i in images])

    def without_images(self, num_seqs: int) -> "ImageInputs":
        """``num_seqs`` sequences holding no image (a placeholder's), on this batch's device."""
        return ImageInputs(self.pixel_values[:0], self.grid_thw[:0], [0] * num_seqs, [])

    def to(self, device) -> "ImageInputs":
        """The same images with their tensors on ``device``."""
        return ImageInputs(self.pixel_values.to(device, non_blocking=True), self.grid_thw.to(device, non_blocking=True),
                           self.images_per_seq, self.patches)

    @staticmethod
    def cat(parts: list["ImageInputs"]) -> "ImageInputs":
        """The images of several batches' sequences, one batch after the other."""
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.grid_thw for p in parts]),
                           [n for p in parts for n in p.images_per_seq], [n for p in parts for n in p.patches])

    def model_inputs(self) -> dict:
        """The model's image keywords (none when no sequence holds an image)."""
        if not self.num_images:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.grid_thw}


def _jagged_rows(name: str, value, num_seqs: int) -> tuple[torch.Tensor, list[int]]:
    if not (torch.is_tensor(value) and value.is_nested and value.layout == torch.jagged):
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"batch[{name!r}]: expected a jagged nested tensor (B, j, ...) with one entry per "
                         f"sequence (docs/vision-language.md), got {shape}")
    if value.lengths() is not None:
        value = value.contiguous()
    if value.shape[0] != num_seqs:
        raise ValueError(f"batch[{name!r}]: holds {value.shape[0]} sequences, input_ids {num_seqs}")
    return value.values(), value.offsets().diff().tolist()


def images_from_batch(batch, num_seqs: int) -> ImageInputs | None:
    """The caller's image fields (module docstring) checked against each other, or None when
    the batch has neither."""
    present = [k for k in IMAGE_KEYS if k in batch.keys()]
    if not present:
        return None
    if len(present) == 1:
        missing = next(k for k in IMAGE_KEYS if k not in present)
        raise ValueError(f"batch[{present[0]!r}] comes without batch[{missing!r}]: images need both")
    pixels, rows_per_seq = _jagged_rows("pixel_values", batch["pixel_values"], num_seqs)
    grids, images_per_seq = _jagged_rows("image_grid_thw", batch["image_grid_thw"], num_seqs)
    if grids.dim() != 2 or grids.shape[1] != 3 or grids.is_floating_point():
        raise ValueError(f"batch['image_grid_thw']: expected integer (t, h, w) rows, got {tuple(grids.shape)} "
                         f"{grids.dtype}")
    grids = grids.long()
    patches = grids.prod(-1).tolist()  # the one host read of the grids
    first = 0
    for seq, (count, rows) in enumerate(zip(images_per_seq, rows_per_seq)):
        wanted = sum(patches[first:first + count])
        if wanted != rows:
            raise ValueError(f"sequence {seq}: pixel_values has {rows} patch rows, its image_grid_thw "
                             f"{grids[first:first + count].tolist()} needs {wanted} (t*h*w per image)")
        first += count
    return ImageInputs(pixels, grids, images_per_seq, patches)


def _check_image_tokens(seq: int, types: list[int], tokens_per_image: list[int]) -> None:
    """Each run of image tokens in the sequence must be one image, as long as its grid says."""
    runs = [len(list(group)) for kind, group in itertools.groupby(types) if kind == 1]
    if runs != tokens_per_image:
        raise ValueError(f"sequence {seq}: its image tokens form runs of {runs} tokens, its image_grid_thw "
                         f"gives {tokens_per_image} (t*h*w / merge^2 per image, one run per image)")


def mrope_positions(rope_index, image_token_id: int, merge: int, input_ids: torch.Tensor, seq_lens: list[int],
                    images: ImageInputs | None, video_token_id: int | None = None) -> list[torch.Tensor]:
    """Each sequence's ``(3, length)`` rotary positions, computed alone by the model's
    ``rope_index`` (``get_rope_index``), on the host: ``input_ids`` is the flat ``(total,)`` row.
    A text-only sequence counts 0, 1, 2, ... on all three rows. Raises, naming the sequence,
    when its image tokens do not match its grids, or when it holds video tokens (not supported:
    they would run as text)."""
    ids = input_ids.cpu()
    grid_host = None if images is None else images.grid_thw.cpu()
    first_image = [0, *itertools.accumulate(images.images_per_seq)] if images is not None else None
    out, start = [], 0
    for seq, length in enumerate(seq_lens):
        row = ids[start:start + length]
        start += length
        if video_token_id is not None and bool((row == video_token_id).any()):
            raise ValueError(f"sequence {seq}: holds video tokens (id {video_token_id}); videos are not supported "
                             f"yet (docs/vision-language.md)")
        types = (row == image_token_id).to(torch.int)
        grids = grid_host[first_image[seq]:first_image[seq + 1]] if images is not None else grid_host
        tokens_per_image = [] if grids is None else (grids.prod(-1) // (merge * merge)).tolist()
        _check_image_tokens(seq, types.tolist(), tokens_per_image)
        if not tokens_per_image:
            out.append(torch.arange(length).expand(3, length))
            continue
        positions, _ = rope_index(row[None], mm_token_type_ids=types[None], image_grid_thw=grids)
        out.append(positions[:, 0])
    return out
