"""Prompt tokens: chat templates and the prompt-length policy (``data.max_prompt_length``,
``data.overlong``).

Every prompt is encoded once, up front for file data, so the batches the trainer sees hold
exactly the ids ``apply_chat_template`` gives, and over-long prompts are dealt with before
any model is built instead of running silently slowly.
"""
from __future__ import annotations

import dataclasses
import logging

from .sources import tokenized_text
from ..errors import DataError
from .example import Example
from .images import VISION_MODEL_FIX

logger = logging.getLogger(__name__)

OVERLONG_POLICIES = ("filter", "error", "truncate")


class PromptEncoder:
    """Encodes an Example's prompt: chat messages through the tokenizer's template; a string
    as ``<bos>`` + its tokens, or as one user message when ``apply_chat_template``. A prompt
    with images goes through ``processor`` (a vision-language model's; trainer/data/vision.py)."""

    def __init__(self, tokenizer, apply_chat_template: bool = False, max_prompt_length: int | None = None,
                 overlong: str = "filter", model_path: str | None = None, grow_vocabulary: bool = False,
                 processor=None, processor_factory=None) -> None:
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong: got {overlong!r}; allowed values: {', '.join(OVERLONG_POLICIES)}")
        self.tokenizer, self.chat = tokenizer, apply_chat_template
        self.max_len, self.overlong = max_prompt_length, overlong
        self.model_path = model_path
        self.grow_vocabulary = grow_vocabulary
        self.added_characters = ""
        # A preset's processor wraps the character tokenizer: built at first use, once the
        # tokenizer has learnt the data's characters (learn_characters).
        self.processor, self.processor_factory = processor, processor_factory

    def learn_characters(self, examples) -> None:
        """With ``grow_vocabulary`` (a preset's character tokenizer, before its model is
        built), add every character the data uses that the tokenizer lacks: a file's text
        is then never cut to ``<unk>``, and the model's vocabulary is sized to match."""
        if self.grow_vocabulary and hasattr(self.tokenizer, "add_chars"):
            self.added_characters = self.tokenizer.add_chars("".join(tokenized_text(ex) for ex in examples))

    def ids(self, example: Example) -> list[int]:
        """The prompt's token ids, before the length policy."""
        messages = example.messages
        if messages is None and self.chat:
            messages = ({"role": "user", "content": example.prompt},)
        if messages is None:
            ids = text_prompt_tokens(self.tokenizer, example.prompt)
        else:
            if not getattr(self.tokenizer, "has_chat_template", False):
                which = f"model.path={self.model_path}" if self.model_path else "the model"
                raise DataError(f"{example.where}: prompt is a list of chat messages, but the tokenizer of {which} "
                                f"has no chat template; add a chat_template to its tokenizer_config.json or give "
                                f"the prompt as a string")
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        if not ids:
            raise DataError(f"{example.where}: prompt {example.prompt!r} has no tokens and the tokenizer has no bos "
                            f"token to start it; every prompt needs at least one token")
        return ids

    def _encode_with_images(self, example: Example) -> Example:
        from .vision import encode_image_prompt

        if self.processor is None and self.processor_factory is not None:
            self.processor = self.processor_factory()
        if self.processor is None:
            which = f"model.path={self.model_path}" if self.model_path else "the model"
            raise DataError(f"{example.where}: field 'images': the record has {len(example.images)} images, but "
                            f"{which} has no image processor (not a vision-language model); {VISION_MODEL_FIX}")
        return encode_image_prompt(self.processor, example)

    def encode(self, example: Example) -> Example | None:
        """``example`` with ``prompt_ids`` set, after the length policy (None: filtered out)."""
        if example.images:
            example = self._encode_with_images(example)
            if self.max_len is not None and len(example.prompt_ids) > self.max_len and self.overlong == "truncate":
                # Cutting the front would cut image tokens away from their pixels.
                raise DataError(f"{example.where}: prompt with images has {len(example.prompt_ids)} tokens, more "
                                f"than data.max_prompt_length={self.max_len}, and data.overlong=truncate cannot cut "
                                f"a prompt with images; raise it or set data.overlong=filter")
        ids = list(example.prompt_ids) if example.images else self.ids(example)
        if self.max_len is not None and len(ids) > self.max_len:
            if self.overlong == "error":
                raise DataError(f"{example.where}: prompt has {len(ids)} tokens, more than data.max_prompt_length="
                                f"{self.max_len}; raise it, or set data.overlong=filter (drop such prompts) or "
                                f"data.overlong=truncate (keep their last tokens)")
            if self.overlong == "filter":
                return None
            ids = ids[-self.max_len:]  # left-truncate: the end of a prompt leads into the answer
        return dataclasses.replace(example, prompt_ids=tuple(ids))

    def encode_split(self, examples: list[Example], split: str) -> list[Example]:
        """Encode a whole split; filtered prompts are counted in one log line."""
        kept = [e for e in (self.encode(ex) for ex in examples) if e is not None]
        dropped = len(examples) - len(kept)
        if dropped:
            logger.info("data.max_prompt_length=%d: filtered %d of %d %s prompts longer than that "
                        "(data.overlong=filter)", self.max_len, dropped, len(examples), split)
        return kept


def text_prompt_tokens(tokenizer, text: str) -> list[int]:
    """``<bos>`` (when the tokenizer has one) followed by ``text``'s tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + tokenizer.encode(text)


def example_prompt_tokens(tokenizer, example: Example) -> list[int]:
    """The prompt ids an Example carries, else ``<bos>`` + its text's tokens (built-in task)."""
    if example.prompt_ids is not None:
        return list(example.prompt_ids)
    return text_prompt_tokens(tokenizer, example.prompt)


def model_max_positions(model_section) -> int | None:
    """``max_position_embeddings`` of the configured model (its config.json, or the preset
    with its overrides); None when it cannot be told without building the model."""
    import json
    import os

    try:
        if model_section.path:
            with open(os.path.join(model_section.path, "config.json")) as f:
                value = json.load(f).get("max_position_embeddings")
        else:
            from polyfsdp.engines.presets import preset_config

            value = getattr(preset_config(model_section.preset, **dict(model_section.overrides)),
                            "max_position_embeddings", None)
    except (OSError, ValueError, TypeError):
        return None  # unreadable configs are reported where the model is built
    return value if isinstance(value, int) else None


def check_position_budget(source, max_positions: int | None, new_tokens: int, new_tokens_key: str) -> None:
    """Refuse a run whose longest prompt plus ``new_tokens`` exceeds the model's positions:
    it would run on positions the model never learned, silently and slowly."""
    if max_positions is None:
        return
    examples = getattr(source, "train_examples", []) + list(source.eval_examples)
    encoded = [ex for ex in examples if ex.prompt_ids is not None]
    if not encoded:
        return
    longest = max(encoded, key=lambda ex: len(ex.prompt_ids))
    need = len(longest.prompt_ids) + new_tokens
    if need > max_positions:
        fit = max_positions - new_tokens
        hint = (f"set data.max_prompt_length={fit} (data.overlong=filter drops longer prompts, truncate keeps their "
                f"end)" if fit >= 1 else f"lower {new_tokens_key}")
        raise DataError(f"{longest.where or 'a prompt'}: prompt of {len(longest.prompt_ids)} tokens + "
                        f"{new_tokens_key}={new_tokens} needs {need} positions, but the model has "
                        f"max_position_embeddings={max_positions}; {hint}")


# What the probe conversation's assistant says: text no template adds or rewrites.
_TURN_PROBE = "polyfsdp end of turn probe"


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special token the tokenizer's chat template closes an assistant turn with, when it
    is not ``<eos>`` (ChatML's ``<|im_end|>`` where eos is ``<|endoftext|>``, Llama 3's
    ``<|eot_id|>``, Gemma's ``<end_of_turn>``): a model tuned on the template ends its answers
    with it, so sampling must stop there too. Found by rendering a one-exchange conversation
    and taking the first token after the assistant's text (whitespace skipped); None without a
    chat template, or when that token is eos or no special token."""
    hf = getattr(tokenizer, "tok", tokenizer)  # HFTokenizerAdapter wraps the Hugging Face tokenizer
    if not getattr(hf, "chat_template", None) or not hasattr(hf, "all_special_ids"):
        return None
    exchange = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = hf.apply_chat_template(exchange, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no end-of-turn token known
        return None
    if not isinstance(text, str) or _TURN_PROBE not in text:
        return None
    special = set(hf.all_special_ids) | {i for i, t in getattr(hf, "added_tokens_decoder", {}).items()
                                         if getattr(t, "special", False)}
    for token in hf.encode(text[text.rindex(_TURN_PROBE) + len(_TURN_PROBE):], add_special_tokens=False):
        if token in special:
            return None if token == tokenizer.eos_token_id else int(token)
        if hf.decode([token]).strip():
            return None  # text, not a special token, closes the turn
    return None
