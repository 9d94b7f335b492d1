"""Shared set-up of the vLLM tests with images (tests/cpu/trainer/rollout/test_vllm_images.py,
colocated; tests/cpu/trainer/rollout/servers/test_server_images.py, on servers): tiny Qwen2-VL
and Qwen2.5-VL checkpoints vLLM's CPU attention runs (head size 32), prompts with 0, 1 and 2
images, and the independent reference of a sampled completion's log-probs."""
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.engines.presets import preset_config
from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.vision import tiny_vision_processor
from polyfsdp.trainer.rollout.decode import placeholder_tokens

TOK = CharTokenizer()
PRESETS = ("qwen2-vl-tiny", "qwen2.5-vl-tiny")
# Head size 32 (64 / 2), the smallest vLLM's CPU attention runs; its 16 rotary frequencies over (t, h, w).
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})


def vlm_policy(preset: str, directory, seed: int = 4):
    """``(policy, processor)``: a random ``preset`` checkpoint written to ``directory``, loaded by the engine."""
    config = preset_config(preset, **SIZES)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(directory)
    policy = FSDPEngine(ModelConfig(path=str(directory)), EngineConfig(), OptimConfig(lr=5e-2)).initialize()
    return policy, tiny_vision_processor(TOK, config)


def picture(size, colour):
    image = Image.new("RGB", size, (250, 250, 250))
    image.paste(colour, (0, 0, size[0] // 2, size[1] // 2))
    return image


def image_prompts(processor) -> list[Example]:
    """Four encoded prompts: 1 image, none, 2 images, and the first's tokens with other pixels."""
    encoder = PromptEncoder(TOK, processor=processor)

    def ask(text, *images):
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        return encoder.encode(Example(prompt=text, answer="", where=f"prompt {text!r}", images=images,
                                      messages=({"role": "user", "content": tuple(parts)},) if images else
                                      ({"role": "user", "content": text},)))

    return [ask("how many?", picture((56, 28), (200, 0, 0))), ask("none here"),
            ask("and?", picture((56, 56), (0, 0, 200)), picture((28, 28), (0, 200, 0))),
            ask("how many?", picture((56, 28), (0, 120, 240)))]


def reference_log_probs(model, row, completion) -> list[float]:
    """HF's forward of ``row``'s prompt + ``completion`` alone: each completion token's log-prob,
    renormalized without the placeholders (which neither sampler draws)."""
    ids = torch.tensor([list(row.prompt_ids) + completion])
    images = {} if row.pixel_values is None else {
        "pixel_values": row.pixel_values, "image_grid_thw": row.image_grid_thw,
        "mm_token_type_ids": (ids == model.config.image_token_id).to(torch.int)}
    with torch.no_grad():
        logits = model(input_ids=ids, **images).logits[0].float()
    logits[:, placeholder_tokens(model)] = float("-inf")
    log_probs = logits.log_softmax(-1)
    start = len(row.prompt_ids) - 1
    return [log_probs[start + t, token].item() for t, token in enumerate(completion)]
