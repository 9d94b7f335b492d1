"""The image requests of the rollout servers and the refusals shared with the colocated engine
(trainer/rollout/servers/vision_serving.py, completions.py), without vLLM: a picture travels as a
lossless PNG holding the pixels the trainer's processor read; each image's run of placeholders is
written once; an answer whose expanded prompt differs from the trainer's, a text policy given
images, an Example with pixel inputs but no images, and too many images are one line each."""
import base64
import io

import pytest
import torch
from PIL import Image

from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.servers.completions import image_request, parse_image_answer, png_data_url
from polyfsdp.trainer.rollout.servers.http import ServerError
from polyfsdp.trainer.rollout.servers.vision_serving import (MAX_IMAGES_PER_PROMPT, VisionServing,
                                                              collapse_image_runs, prompt_pictures)

IMAGE = 7  # the image placeholder token of these prompts


def _example(images=(), pixels=True, where="data.jsonl record 3"):
    return Example(prompt="q", answer="1", where=where, images=tuple(images),
                   pixel_values=torch.zeros(4, 1176) if pixels else None,
                   image_grid_thw=torch.tensor([[1, 2, 2]]) if pixels else None)


def test_a_picture_travels_as_the_rgb_pixels_the_processor_read():
    picture = Image.new("RGBA", (5, 3), (10, 200, 30, 128))
    url = png_data_url(picture)
    assert url.startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert decoded.mode == "RGB" and decoded.tobytes() == picture.convert("RGB").tobytes()


def test_an_image_request_writes_each_run_once_and_bans_the_placeholders():
    prompt = [1, IMAGE, IMAGE, IMAGE, 3, IMAGE, IMAGE, 4]
    assert collapse_image_runs(prompt, IMAGE) == [1, IMAGE, 3, IMAGE, 4]
    params = SamplingParams(5, temperature=0.7, stop_token_ids=(2,), return_log_probs=True)
    body = image_request("m", prompt, [Image.new("RGB", (2, 2)), Image.new("RGB", (2, 2))], params, 11, IMAGE,
                         {IMAGE: -100.0, 8: -100.0})
    assert body["token_ids"] == [1, IMAGE, 3, IMAGE, 4] and len(body["content_parts"]) == 2
    assert all(part["type"] == "image_url" for part in body["content_parts"])
    sampling = body["sampling_params"]
    assert sampling["seed"] == 11 and sampling["max_tokens"] == 5 and sampling["logprobs"] == 0
    assert sampling["logit_bias"] == {"7": -100.0, "8": -100.0} and sampling["detokenize"] is False


def test_an_answer_whose_expanded_prompt_differs_from_the_trainers_is_one_line():
    prompt = [1, IMAGE, IMAGE, 3]
    good = {"prompt_token_ids": prompt, "choices": [{"token_ids": [5, 2], "logprobs": {"content": [
        {"token_id": 5, "logprob": -0.5}, {"token_id": 2, "logprob": -0.25}]}}]}
    assert parse_image_answer(good, prompt, IMAGE, True, "rollout server 0 (http://h:1)") == ([5, 2], [-0.5, -0.25])
    other = {**good, "prompt_token_ids": [1, IMAGE, IMAGE, IMAGE, 3]}
    with pytest.raises(ServerError) as err:
        parse_image_answer(other, prompt, IMAGE, True, "rollout server 0 (http://h:1)")
    assert str(err.value).startswith("rollout server 0 (http://h:1): vLLM's processor ran the prompt as 5 tokens "
                                     "(3 image tokens), the trainer's sequence holds 4 (2), first different at "
                                     "position 3: vLLM must load the run's processor")
    assert "\n" not in str(err.value)
    with pytest.raises(ServerError, match=r"--enable-scale-out"):
        parse_image_answer({"detail": "Not Found"}, prompt, IMAGE, True, "rollout server 0 (http://h:1)")


def test_the_refusals_name_what_to_fix():
    vision = VisionServing("Qwen2VLForConditionalGeneration", None, IMAGE, [IMAGE, 8], None)
    picture = Image.new("RGB", (2, 2))
    assert prompt_pictures([_example([picture]), None], vision, "k") == [[picture], None]
    assert prompt_pictures([None, _example(pixels=False)], vision, "k") is None  # text rows only
    with pytest.raises(ConfigError, match=r"^k: prompts with images, but the policy is a text model"):
        prompt_pictures([_example([picture])], None, "k")
    with pytest.raises(ConfigError, match=r"^k: data.jsonl record 3: the prompt holds pixel inputs but not the "
                                          r"images they came from"):
        prompt_pictures([_example([picture]), _example()], vision, "k")
    with pytest.raises(ConfigError, match=rf"^k: a prompt holds more than {MAX_IMAGES_PER_PROMPT} images"):
        prompt_pictures([_example([picture] * (MAX_IMAGES_PER_PROMPT + 1))], vision, "k")
    assert vision.logit_bias == {IMAGE: -100.0, 8: -100.0}
