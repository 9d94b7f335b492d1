"""Engine batches from (prompt, response) token lists, in either pad mode.

Per-token fields follow the engine's alignment (engines/losses/inputs.py): position ``t``
describes the prediction of token ``t + 1``, so ``response_mask[t] = 1`` exactly when
``x[t + 1]`` is a response token.
"""
from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict

from polyfsdp.engines.jagged import make_jagged


def _seq_values(prompt: Sequence[int], response: Sequence[int],
                loss_mask: Sequence[int] | None = None) -> tuple[list[int], list[float]]:
    """Ids and response mask of ``prompt + response``; ``loss_mask`` (one 0/1 per response token,
    multi-turn) keeps only the tokens the policy sampled."""
    ids = list(prompt) + list(response)
    mask = [0.0] * len(ids)
    if loss_mask is not None and len(loss_mask) != len(response):
        raise ValueError(f"build_batch: a loss mask of {len(loss_mask)} values for {len(response)} response tokens")
    for k, t in enumerate(range(len(prompt) - 1, len(ids) - 1)):
        mask[t] = 1.0 if loss_mask is None else float(loss_mask[k])
    return ids, mask


def build_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_mode: str, pad_token_id: int,
                token_fields: dict[str, Sequence[torch.Tensor]] | None = None,
                images: Sequence | None = None) -> TensorDict:
    """A TensorDict with ``input_ids``, ``response_mask`` (and ``attention_mask`` for
    ``left_right``) for sequences ``prompt + response``; a pair may carry a third item, the
    response's loss mask (multi-turn: 0 for environment tokens). ``token_fields`` are extra
    per-token fields, one flat tensor per sequence (length = its prompt + response). ``images``:
    per sequence, the Example whose prompt it is (or anything with ``pixel_values`` and
    ``image_grid_thw``, None for none); when one holds images the batch gets the engine's jagged
    image fields (docs/vision-language.md)."""
    if not pairs:
        raise ValueError("build_batch: expected at least one (prompt, response) pair, got none")
    for prompt, *_ in pairs:
        if len(prompt) < 1:
            raise ValueError("build_batch: every prompt needs at least one token (e.g. <bos>)")
    seqs = [_seq_values(*pair) for pair in pairs]
    lengths = [len(ids) for ids, _ in seqs]
    fields = {"response_mask": [torch.tensor(m, dtype=torch.float32) for _, m in seqs]}
    for name, values in (token_fields or {}).items():
        if len(values) != len(seqs):
            raise ValueError(f"build_batch: field {name!r} has {len(values)} sequences, expected {len(seqs)}")
        for i, v in enumerate(values):
            if v.shape[0] != lengths[i]:
                raise ValueError(f"build_batch: field {name!r} sequence {i} has {v.shape[0]} values, "
                                 f"expected {lengths[i]}")
        fields[name] = [v.to(torch.float32) for v in values]
    ids = [torch.tensor(s, dtype=torch.long) for s, _ in seqs]
    image_fields = _image_fields(images, len(seqs))
    if pad_mode == "no_padding":
        offsets = torch.tensor([0] + lengths).cumsum(0)
        data = {"input_ids": make_jagged(torch.cat(ids), offsets)}
        for name, values in fields.items():
            data[name] = make_jagged(torch.cat(values), offsets)
        return TensorDict({**data, **image_fields}, batch_size=[len(seqs)])
    if pad_mode == "left_right":
        # Prompts left-padded to a common end, responses right-padded after it.
        p_len = max(len(pair[0]) for pair in pairs)
        r_len = max(len(pair[1]) for pair in pairs)
        width = p_len + r_len
        dense = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), width), dtype=torch.long)
        dense_fields = {name: torch.zeros((len(seqs), width)) for name in fields}
        for i, (prompt, *_) in enumerate(pairs):
            start = p_len - len(prompt)
            end = start + lengths[i]
            dense[i, start:end] = ids[i]
            attention[i, start:end] = 1
            for name, values in fields.items():
                dense_fields[name][i, start:end] = values[i]
        return TensorDict({"input_ids": dense, "attention_mask": attention, **dense_fields, **image_fields},
                          batch_size=[len(seqs)])
    raise ValueError(f"pad_mode: got {pad_mode!r}; allowed values: 'no_padding', 'left_right'")


def _image_fields(images: Sequence | None, num_seqs: int) -> dict:
    """The jagged ``pixel_values`` / ``image_grid_thw`` of ``images`` (one entry per sequence),
    none when no sequence holds an image: a text batch stays exactly as it was."""
    if images is None or all(getattr(x, "pixel_values", None) is None for x in images):
        return {}
    if len(images) != num_seqs:
        raise ValueError(f"build_batch: images for {len(images)} sequences, expected {num_seqs}")
    holders = [x for x in images if getattr(x, "pixel_values", None) is not None]
    width, dtype = holders[0].pixel_values.shape[1], holders[0].pixel_values.dtype
    pixels = [x.pixel_values if getattr(x, "pixel_values", None) is not None else torch.zeros(0, width, dtype=dtype)
              for x in images]
    grids = [x.image_grid_thw.long() if getattr(x, "pixel_values", None) is not None
             else torch.zeros(0, 3, dtype=torch.long) for x in images]
    return {"pixel_values": make_jagged(torch.cat(pixels), torch.tensor([0] + [len(p) for p in pixels]).cumsum(0)),
            "image_grid_thw": make_jagged(torch.cat(grids), torch.tensor([0] + [len(g) for g in grids]).cumsum(0))}


def response_mask(prompt: Sequence[int], response: Sequence[int], loss_mask: Sequence[int] | None = None) -> torch.Tensor:
    """The per-token response mask of ``prompt + response`` (engine alignment), flat; with
    ``loss_mask``, only the response tokens it marks."""
    return torch.tensor(_seq_values(prompt, response, loss_mask)[1], dtype=torch.float32)


def response_field(prompt: Sequence[int], values: Sequence[float]) -> torch.Tensor:
    """Per-response-token ``values`` placed in ``prompt + response``'s alignment (position
    ``len(prompt) - 1 + k`` holds response token ``k``'s value), zeros elsewhere."""
    out = torch.zeros(len(prompt) + len(values))
    out[len(prompt) - 1:len(prompt) - 1 + len(values)] = torch.tensor(list(values), dtype=torch.float32)
    return out


def per_sequence(values: torch.Tensor, batch: TensorDict, pad_mode: str) -> list[torch.Tensor]:
    """Split an engine output in ``batch``'s layout (jagged, or dense aligned with
    ``input_ids``) into one flat tensor per sequence."""
    if pad_mode == "no_padding":
        return [t.clone() for t in values.unbind()]
    mask = batch["attention_mask"].bool()
    return [values[i][mask[i]] for i in range(values.shape[0])]
