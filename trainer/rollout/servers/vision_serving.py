"""What a vLLM sampler needs to serve a vision-language policy, the colocated engine
(trainer/rollout/vllm.py) and the rollout servers (engine.py) alike:

- the run's processor written beside the weights, with the architecture polyfsdp registers in
  vLLM (vllm_vision.py), so vLLM sizes and places every image exactly as the prompts were encoded;
- the tokens sampling never draws: the image and video placeholders, as in our loops
  (trainer/rollout/decode.py), banned by a logit bias of -100 (vLLM's largest: their share of
  the mass drops below e^-100, so the reported log-probs are those renormalized without them to
  far better than float precision), two entries per request where a list of every allowed token
  would be the whole vocabulary (150k ids for Qwen2-VL, a megabyte of JSON per row on a server);
- check_sync's second probe (:class:`ImageProbe`), which runs the vision tower and the merger;
- the prompt as vLLM takes it: each image's run of placeholders written once (vLLM's processor
  repeats it once per image token itself).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from .vllm_plugin import VISION_MODELS

# Images one prompt may hold (vLLM's limit_mm_per_prompt; its start-up profiles a prompt with this many).
MAX_IMAGES_PER_PROMPT = 4
BAN_BIAS = -100.0  # vLLM clamps a logit bias to [-100, 100]


class ImageProbe:
    """A vision-language policy's second sync probe: the text probe behind a fixed generated
    picture, so that the vision tower's and the merger's weights are checked too (the text probe
    runs the decoder only). ``ids`` holds the picture's image tokens as the run's ``processor``
    sizes it; ``pixel_values`` and ``image_grid_thw`` are its pixel inputs for the policy."""

    def __init__(self, processor, config, text_probe: list[int]) -> None:
        from PIL import Image

        self.picture = Image.linear_gradient("L").resize((56, 28)).convert("RGB")
        inputs = processor.image_processor(images=[self.picture], return_tensors="pt")
        self.pixel_values, self.image_grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
        tokens = int(self.image_grid_thw.prod()) // config.vision_config.spatial_merge_size ** 2
        image = [config.vision_start_token_id, *[config.image_token_id] * tokens, config.vision_end_token_id]
        self.ids = text_probe[:1] + image + text_probe[1:max(2, len(text_probe) - len(image))]


@dataclass
class VisionServing:
    """A vision-language policy's serving facts (see the module); :meth:`write` puts its processor
    beside the weights vLLM loads."""

    architecture: str
    processor: object
    image_token_id: int
    banned_token_ids: list[int]
    probe: ImageProbe

    @property
    def logit_bias(self) -> dict[int, float]:
        """What bans the placeholders in a vLLM request (see the module)."""
        return {token: BAN_BIAS for token in self.banned_token_ids}

    def write(self, directory: str, config) -> None:
        """The processor into ``directory``; ``config`` (saved there after this) names the architecture."""
        config.architectures = [self.architecture]
        self.processor.save_pretrained(directory)


def is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_serving(policy, processor_factory, text_probe: list[int], engine_key: str) -> VisionServing:
    """``policy``'s serving facts, built with its processor from ``processor_factory``; ``engine_key``
    names the sampler in the one-line errors (``rollout.engine=vllm``)."""
    architecture = type(policy.module).__name__
    if architecture not in VISION_MODELS:
        raise ConfigError(f"{engine_key}: vLLM samples for polyfsdp from {' and '.join(VISION_MODELS)} only among "
                          f"vision-language models, not {architecture}; use rollout.engine=auto")
    processor = processor_factory() if processor_factory is not None else None
    if processor is None:
        raise ConfigError(f"{engine_key}: the vision-language policy {architecture} came without its processor "
                          f"(the job hands it over; RolloutEngine.processor_factory)")
    from ..decode import placeholder_tokens  # the engine's modules: never imported in vLLM's processes

    config = policy.module.config
    return VisionServing(architecture, processor, config.image_token_id, sorted(placeholder_tokens(policy.module)),
                         ImageProbe(processor, config, text_probe))


def prompt_pictures(images: list | None, vision: VisionServing | None, engine_key: str) -> list | None:
    """Per prompt its pictures (a list of PIL images) or None, from the engines' ``images`` (one
    Example or None per prompt); None when no prompt holds any. One line for images sent to a text
    model, an Example with pixel inputs but not the images they came from (vLLM processes the
    images itself: sampled without them, the prompt's image tokens would stand for nothing), or more
    images in one prompt than vLLM is started for."""
    if images is None or not any(ex is not None and (ex.images or ex.pixel_values is not None) for ex in images):
        return None
    if vision is None:
        raise ConfigError(f"{engine_key}: prompts with images, but the policy is a text model (its config has no "
                          f"vision_config); use a vision-language model (model=qwen2_vl or its checkpoint)")
    blind = next((ex for ex in images if ex is not None and ex.pixel_values is not None and not ex.images), None)
    if blind is not None:
        raise ConfigError(f"{engine_key}: {blind.where}: the prompt holds pixel inputs but not the images they came "
                          f"from (Example.images), which vLLM processes itself")
    pictures = [list(ex.images) if ex is not None and ex.images else None for ex in images]
    if max(len(p or ()) for p in pictures) > MAX_IMAGES_PER_PROMPT:
        raise ConfigError(f"{engine_key}: a prompt holds more than {MAX_IMAGES_PER_PROMPT} images, the most vLLM "
                          f"is started for; use rollout.engine=auto")
    return pictures


def collapse_image_runs(ids: list[int], image_token_id: int | None) -> list[int]:
    """``ids`` with each run of image tokens written once (vLLM's processor expands it again)."""
    return [t for i, t in enumerate(ids) if not (t == image_token_id and i > 0 and ids[i - 1] == image_token_id)]


def expansion_mismatch(served: list[int], prompt: list[int], image_token_id: int | None) -> str | None:
    """Why vLLM's expansion of a prompt's images (``served``: the prompt token ids it ran) cannot be
    trained on: its processor made other tokens than the trainer's (``prompt``), so nothing it
    samples would match the trainer's sequence; None when they are equal."""
    served, prompt = list(served), list(prompt)
    if served == prompt:
        return None
    first = next((i for i, (a, b) in enumerate(zip(served, prompt)) if a != b), min(len(served), len(prompt)))
    return (f"vLLM's processor ran the prompt as {len(served)} tokens ({served.count(image_token_id)} image tokens), "
            f"the trainer's sequence holds {len(prompt)} ({prompt.count(image_token_id)}), first different at "
            f"position {first}: vLLM must load the run's processor (polyfsdp writes it beside the weights of the "
            f"engines and servers it starts; a server started by hand needs it in its --model directory, e.g. an "
            f"HF export of the run)")
