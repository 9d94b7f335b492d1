"""Tiny vision-language batches and an independent reference for the engine's VLM tests: the
Hugging Face model (eager attention) on each sequence alone, with its own positions."""
from __future__ import annotations

import torch
from tensordict import TensorDict
from transformers import AutoModelForImageTextToText

from tests.helpers.engine_reference import jagged_of, left_right_dense, prompt_lengths
from polyfsdp.engines.presets import VLM_TOKENS, preset_config

VLM_PRESETS = ["qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny"]
# in_channels x temporal_patch_size x patch_size^2 of the presets' towers.
PATCH_WIDTH = 3 * 2 * 14 * 14
MERGE = 2
IMAGE = VLM_TOKENS["image_token_id"]
TEXT_VOCAB = min(VLM_TOKENS.values())  # text tokens stay below the special ones
# Patch grids (t, h, w): a 28x28 image (1 token), 28x56 (2 tokens, h != w), 56x56 (4 tokens).
GRIDS = {"small": (1, 2, 2), "wide": (1, 2, 4), "square": (1, 4, 4)}


def vlm_sequence(images: list[str], generator: torch.Generator, text: int = 3) -> dict:
    """One sequence: ``text`` tokens before each image (vision start, image tokens, vision
    end) and after the last, with random pixel rows for each of ``images`` (GRIDS' names)."""
    def words(n):
        return torch.randint(0, TEXT_VOCAB, (n,), generator=generator)

    parts, pixels, grids = [words(text)], [], []
    for name in images:
        t, h, w = GRIDS[name]
        parts += [torch.tensor([VLM_TOKENS["vision_start_token_id"]]), torch.full((t * h * w // MERGE ** 2,), IMAGE),
                  torch.tensor([VLM_TOKENS["vision_end_token_id"]]), words(text)]
        pixels.append(torch.randn(t * h * w, PATCH_WIDTH, generator=generator))
        grids.append(torch.tensor([t, h, w]))
    return {"ids": torch.cat(parts), "pixels": torch.cat(pixels) if pixels else torch.zeros(0, PATCH_WIDTH),
            "grids": torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long)}


def vlm_sequences(spec: list[list[str]], seed: int = 0, text: int = 3) -> list[dict]:
    """One sequence per entry of ``spec`` (its images by GRIDS name; [] for a text-only row)."""
    g = torch.Generator().manual_seed(seed)
    return [vlm_sequence(images, g, text + i % 3) for i, images in enumerate(spec)]


def vlm_batch(seqs: list[dict], pad_mode: str, per_token: dict | None = None) -> TensorDict:
    """The engine's batch: input_ids in ``pad_mode``'s layout, the images as per-sequence jagged fields."""
    ids = [s["ids"] for s in seqs]
    data = {"pixel_values": jagged_of([s["pixels"] for s in seqs]),
            "image_grid_thw": jagged_of([s["grids"] for s in seqs])}
    if pad_mode == "no_padding":
        data["input_ids"] = jagged_of(ids)
        data.update({name: jagged_of(parts) for name, parts in (per_token or {}).items()})
    else:
        prompts = prompt_lengths(ids)
        data["input_ids"], data["attention_mask"] = left_right_dense(ids, prompts)
        data.update({name: left_right_dense(parts, prompts)[0] for name, parts in (per_token or {}).items()})
    return TensorDict(data, batch_size=[len(seqs)])


def vlm_reference_model(preset: str, state_dict: dict):
    """A plain HF vision-language model (eager attention everywhere) holding ``state_dict``."""
    model = AutoModelForImageTextToText.from_config(preset_config(preset), attn_implementation="eager")
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.eval()


def vlm_reference_logprobs(model, seqs: list[dict], temperatures: list[float]):
    """Per sequence, alone, through HF's forward (its own mrope positions from its
    get_rope_index): log_softmax(logits / T) at the next token and the entropy, last position 0."""
    lps, ents = [], []
    for seq, t in zip(seqs, temperatures):
        ids = seq["ids"]
        images = {}
        if len(seq["grids"]):
            images = {"pixel_values": seq["pixels"], "image_grid_thw": seq["grids"],
                      "mm_token_type_ids": (ids == IMAGE).int()[None]}
        logits = model(input_ids=ids[None], use_cache=False, **images).logits[0].double() / float(t)
        logp = torch.log_softmax(logits, -1)
        lp = torch.zeros(len(ids), dtype=torch.float64)
        ent = torch.zeros(len(ids), dtype=torch.float64)
        lp[:-1] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
        ent[:-1] = -(logp[:-1].exp() * logp[:-1]).sum(-1)
        lps.append(lp)
        ents.append(ent)
    return lps, ents
