"""Prompts with images through a vision-language model's processor (docs/vision-language.md).

The processor renders the chat (its template writes ``<|vision_start|><|image_pad|><|vision_end|>``
for each image part), its image processor turns the images into ``pixel_values`` and
``image_grid_thw``, and it repeats each ``<|image_pad|>`` once per image token (t*h*w / merge^2):
exactly what the engine's batch fields and the model expect. A local checkpoint brings its own
processor files (``preprocessor_config.json``; :func:`load_processor`). A tiny preset has no
files: :func:`tiny_vision_processor` builds the model family's Hugging Face processor from the
preset's config around the character tokenizer, whose vocabulary gains the vision tokens at the
config's ids (the ids between the characters and them are reserved: never written, never read).
"""
from __future__ import annotations

import dataclasses
import os

from ..errors import DataError
from .char_tokenizer_hf import hf_tokenizer_of

VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
# A processor's files: transformers 5 writes processor_config.json, checkpoints on the hub hold
# preprocessor_config.json.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# The character tokenizer's chat rendering (CharTokenizer.chat_text) with Qwen2-VL's image markup.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}[{{ message['role'] }}] "
                 "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                 "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
                 "{% endif %}{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
# Image sizes the tiny presets' processor keeps: 1 to 16 image tokens (28x28 to 112x112 pixels).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 28 * 28, 112 * 112


def _image_only_processor_class(model_type: str):
    """The family's processor class without its video processor (videos are not supported yet,
    and transformers builds video processors only with torchvision installed)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    classes = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}
    if model_type not in classes:
        raise ValueError(f"no built-in processor for model type {model_type!r}; known: {', '.join(classes)}")
    family = classes[model_type]

    class ImageOnlyProcessor(family):
        # transformers takes a processor's parts from its __init__ signature: no video_processor here.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{family.__name__}"
    return ImageOnlyProcessor


def vision_hf_tokenizer(char_tokenizer, config):
    """``char_tokenizer`` as a Hugging Face tokenizer whose vocabulary also holds the vision
    tokens at ``config``'s ids (``<|reserved_k|>`` fill the ids between)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    ids = {VISION_TOKENS[key]: getattr(config, key) for key in VISION_TOKENS}
    if min(ids.values()) < char_tokenizer.vocab_size:
        raise ValueError(f"the character tokenizer's {char_tokenizer.vocab_size} tokens reach the model's vision "
                         f"token ids ({min(ids.values())} and up): the data holds too many distinct characters")
    vocab = {token: i for i, token in enumerate(char_tokenizer.vocab)}
    taken = set(ids.values())
    vocab.update({f"<|reserved_{i}|>": i for i in range(char_tokenizer.vocab_size, max(taken)) if i not in taken})
    vocab.update(ids)
    base = hf_tokenizer_of(char_tokenizer)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=base.unk_token))
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{base.bos_token} $A", pair=f"{base.bos_token} $A $B:1",
        special_tokens=[(base.bos_token, char_tokenizer.bos_token_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=base.pad_token, bos_token=base.bos_token,
                                  eos_token=base.eos_token, unk_token=base.unk_token, chat_template=CHAT_TEMPLATE,
                                  clean_up_tokenization_spaces=False,
                                  additional_special_tokens=sorted(ids, key=ids.get))
    return tok


def tiny_vision_processor(char_tokenizer, config, min_pixels: int = TINY_MIN_PIXELS,
                          max_pixels: int = TINY_MAX_PIXELS):
    """The Hugging Face processor of ``config``'s family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) for a
    tiny preset: its image processor sized by the vision config, the tokenizer above."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.vision_config
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size, min_pixels=min_pixels, max_pixels=max_pixels)
    cls = _image_only_processor_class(config.model_type)
    return cls(image_processor=image_processor, tokenizer=vision_hf_tokenizer(char_tokenizer, config),
               chat_template=CHAT_TEMPLATE)


def load_processor(directory: str):
    """The processor saved in a model directory, or None when it holds none (a text model).
    Where transformers cannot build the family's processor (its video processor needs
    torchvision) it hands back the bare tokenizer: then the family's image-only processor is
    built from the directory's image processor and tokenizer."""
    if not any(os.path.isfile(os.path.join(directory, name)) for name in PROCESSOR_FILES):
        return None
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    local = dict(local_files_only=True, trust_remote_code=False)
    try:
        processor = AutoProcessor.from_pretrained(directory, **local)
        if getattr(processor, "image_processor", None) is not None:
            return processor
    except (ImportError, AttributeError, ValueError, TypeError):
        pass  # no torchvision: the family's processor cannot be built whole
    tokenizer = AutoTokenizer.from_pretrained(directory, **local)
    cls = _image_only_processor_class(AutoConfig.from_pretrained(directory, **local).model_type)
    return cls(image_processor=AutoImageProcessor.from_pretrained(directory, **local), tokenizer=tokenizer,
               chat_template=tokenizer.chat_template)


def encode_image_prompt(processor, example):
    """``example`` with ``prompt_ids``, ``pixel_values`` and ``image_grid_thw`` from ``processor``:
    its chat with the images placed (trainer/data/images.py), rendered with the generation prompt."""
    messages = [dict(m, content=list(m["content"]) if not isinstance(m["content"], str) else m["content"])
                for m in example.messages]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    placeholders = text.count(processor.image_token)
    if placeholders != len(example.images):
        raise DataError(f"{example.where}: field 'images': the record gives {len(example.images)} images, but the "
                        f"chat template wrote {placeholders} image placeholders for its prompt")
    try:
        out = processor(text=[text], images=[image.convert("RGB") for image in example.images],
                        return_tensors="pt", add_special_tokens=False)
    except ValueError as exc:  # an image the processor cannot size (too small, wrong aspect ratio)
        raise DataError(f"{example.where}: field 'images': {' '.join(str(exc).split())[:160]}") from None
    return dataclasses.replace(example, prompt_ids=tuple(int(i) for i in out["input_ids"][0]),
                               pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])


def holds_images(example) -> bool:
    """Whether ``example``'s prompt carries images."""
    return bool(example.images)
