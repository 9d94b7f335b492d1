"""The built-in decoding loop with images (trainer/rollout/decode.py): on the tiny
Qwen2-VL, Qwen2.5-VL and Qwen3-VL presets, prompts made by the model family's processor (0, 1 and
2 images, rows with the same tokens but other pixels, a GRPO-like repeated row) decode greedily to
exactly Hugging Face ``generate``'s tokens, finished rows leaving the batch; neither samples the
image/video placeholders; the engine's log-probs of sampled completions are HF's, the sampler's
are HF's renormalized without the placeholders."""
from __future__ import annotations

import warnings

import pytest
import torch
from PIL import Image

from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.presets import preset_config
from polyfsdp.trainer.data.batch import build_batch, per_sequence
from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.vision import tiny_vision_processor
from polyfsdp.trainer.rollout.decode import decode, placeholder_tokens
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import _hf_generate, _left_padded, generate
from tests.helpers.engine_reference import full_state_dict
from tests.helpers.vlm_reference import VLM_PRESETS, vlm_reference_model

warnings.filterwarnings("ignore", message=".*torchvision.*")
TOK = CharTokenizer()


def _image(size, colour):
    image = Image.new("RGB", size, (250, 250, 250))
    image.paste(colour, (0, 0, size[0] // 2, size[1] // 2))
    return image


def _prompts(preset):
    """Encoded Examples: 1 image, none, 2 images, row 0's tokens with other pixels, row 0 again."""
    encoder = PromptEncoder(TOK, processor=tiny_vision_processor(TOK, preset_config(preset)))

    def ask(text, *images):
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        return encoder.encode(Example(prompt=text, answer="", where=f"prompt {text!r}", images=images,
                                      messages=({"role": "user", "content": tuple(parts)},) if images else
                                      ({"role": "user", "content": text},)))

    first = ask("how many?", _image((56, 28), (200, 0, 0)))
    rows = [first, ask("none here"), ask("and?", _image((56, 56), (0, 0, 200)), _image((28, 28), (0, 200, 0))),
            ask("how many?", _image((56, 28), (0, 120, 240))), first]
    assert rows[0].prompt_ids == rows[3].prompt_ids  # same tokens, other pixels: no shared prefill
    return rows


def _params(max_new_tokens, eos, **options):
    return SamplingParams(max_new_tokens, stop_token_ids=(eos,), pad_token_id=TOK.pad_token_id, **options)


@pytest.fixture(scope="module", params=VLM_PRESETS)
def setup(request):
    engine = FSDPEngine(ModelConfig(preset=request.param, seed=2), EngineConfig()).initialize()
    rows = _prompts(request.param)
    ids, mask = _left_padded([list(r.prompt_ids) for r in rows], TOK.pad_token_id)
    return engine, rows, ids, mask


def test_greedy_completions_equal_hf_generate(setup):
    engine, rows, ids, mask = setup
    model = engine.module.eval()
    free = _hf_generate(model, ids, mask, _params(10, TOK.unk_token_id, greedy=True), False, images=rows)
    # A token some rows emit early and others never: finished rows leave the loop's batch.
    counts = {}
    for row in free:
        for tok in set(row[1:-1]):
            counts[tok] = counts.get(tok, 0) + 1
    eos = next((t for t, c in counts.items() if 0 < c < len(free)), TOK.unk_token_id)
    hf = _hf_generate(model, ids, mask, _params(10, eos, greedy=True), False, images=rows)
    ours = decode(model, ids, mask, _params(10, eos, greedy=True), images=rows)
    assert ours == hf
    assert ours[0] == ours[4]
    # Through the rollout entry point, both loops.
    for loop in ("builtin", "hf"):
        out = generate(engine, [list(r.prompt_ids) for r in rows], _params(10, eos, greedy=True), loop=loop,
                       images=rows)
        assert out.token_ids == hf


def test_images_change_what_is_decoded(setup):
    """Without its pixels a row would decode as text: the images must reach the prefill."""
    engine, rows, ids, mask = setup
    model = engine.module.eval()
    params = _params(6, TOK.unk_token_id, greedy=True, return_log_probs=True)
    with_images = decode(model, ids, mask, params, images=rows)[1]
    blank = [r.__class__(prompt=r.prompt, answer="", prompt_ids=r.prompt_ids, images=r.images,
                         pixel_values=None if r.pixel_values is None else torch.zeros_like(r.pixel_values),
                         image_grid_thw=r.image_grid_thw) for r in rows]
    without = decode(model, ids, mask, params, images=blank)[1]
    assert with_images[1] == pytest.approx(without[1], abs=1e-6)  # the text row is untouched
    assert with_images[0] != pytest.approx(without[0], abs=1e-4)


def _reference_log_probs(engine, rows, completions, temperature, placeholders):
    """HF's own forward of each prompt + completion alone: log-probs of the completion's tokens
    over the full vocabulary (the trainer's) and without the placeholder tokens (the sampler's)."""
    model = vlm_reference_model(engine.model_config.preset, full_state_dict(engine.module))
    full, renormalized = [], []
    for row, completion in zip(rows, completions):
        ids = torch.tensor(list(row.prompt_ids) + completion)
        images = {} if row.pixel_values is None else {
            "pixel_values": row.pixel_values, "image_grid_thw": row.image_grid_thw,
            "mm_token_type_ids": (ids == engine.module.config.image_token_id).int()[None]}
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False, **images).logits[0].double() / temperature
        start = len(row.prompt_ids) - 1
        steps, targets = logits[start:start + len(completion)], torch.tensor(completion)[:, None]
        full.append(torch.log_softmax(steps, -1).gather(-1, targets)[:, 0])
        steps[:, placeholders] = float("-inf")
        renormalized.append(torch.log_softmax(steps, -1).gather(-1, targets)[:, 0])
    return full, renormalized


@pytest.mark.parametrize("pad_mode", ["no_padding", "left_right"])
def test_trainer_and_sampler_logprobs_of_sampled_tokens(setup, pad_mode):
    """The engine's log-probs are HF's over the full vocabulary; the sampler's are HF's without the
    image/video placeholders, which it never draws (a sampled one would be an image slot)."""
    engine, rows, ids, mask = setup
    placeholders = placeholder_tokens(engine.module)
    assert placeholders == [engine.module.config.image_token_id, engine.module.config.video_token_id]
    params = _params(8, TOK.eos_token_id, temperature=0.8, return_log_probs=True)
    out = generate(engine, [list(r.prompt_ids) for r in rows], params, loop="builtin", row_seeds=[11, 12, 13, 14, 15],
                   images=rows)
    assert not any(t in placeholders for c in out.token_ids for t in c)
    batch = build_batch([(r.prompt_ids, c) for r, c in zip(rows, out.token_ids)], pad_mode, TOK.pad_token_id,
                        images=rows)
    saved = engine.engine_config
    engine.engine_config = type(saved)(**{**saved.__dict__, "pad_mode": pad_mode})
    try:
        got = engine.infer_batch(batch, temperature=torch.full((len(rows),), 0.8))["log_probs"]
    finally:
        engine.engine_config = saved
    full, renormalized = _reference_log_probs(engine, rows, out.token_ids, 0.8, placeholders)
    for row, seq, sampled, want_full, want_sampled in zip(rows, per_sequence(got, batch, pad_mode), out.log_probs,
                                                          full, renormalized):
        start = len(row.prompt_ids) - 1
        trained = seq[start:start + len(sampled)].double()
        assert (trained - want_full).abs().max().item() <= 1e-5
        assert (torch.tensor(sampled, dtype=torch.float64) - want_sampled).abs().max().item() <= 1e-5


def test_hf_generate_never_samples_the_placeholders(setup):
    engine, rows, ids, mask = setup
    model = engine.module.eval()
    completions = _hf_generate(model, ids, mask, _params(8, TOK.eos_token_id, return_log_probs=True), False,
                               row_seeds=[1, 2, 3, 4, 5], images=rows)[0]
    assert not any(t in placeholder_tokens(model) for c in completions for t in c)
