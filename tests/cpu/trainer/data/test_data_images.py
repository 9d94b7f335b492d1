"""Images in data records (docs/vision-language.md): the ``images``/``image`` fields as file paths,
bytes, base64 text, data URLs and datasets' image structs in JSONL and parquet; their placement in
the chat; the tiny presets' Hugging Face processor; malformed fields in one line; and the engine's
log-probs on a batch built from such records, equal to Hugging Face's forward of the processor's
own output."""
from __future__ import annotations

import base64
import io
import json
import warnings

import pytest
import torch
from PIL import Image

from tests.helpers.engine_reference import full_state_dict
from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.presets import VLM_TOKENS, preset_config
from polyfsdp.trainer.data.batch import build_batch, per_sequence
from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.data.sources import read_jsonl, read_parquet
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.vision import tiny_vision_processor
from polyfsdp.trainer.errors import DataError
from tests.helpers.vlm_reference import VLM_PRESETS, vlm_reference_logprobs, vlm_reference_model

warnings.filterwarnings("ignore", message=".*torchvision.*")


def png(size=(28, 28), colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def record(prompt="how many?", answer="2", **fields):
    return {"prompt": prompt, "reward_model": {"ground_truth": answer}, **fields}


@pytest.fixture
def image_dir(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png((56, 28)))
    return tmp_path


def test_jsonl_images_as_paths_base64_and_data_urls(image_dir):
    b64 = base64.b64encode(png((28, 56), (0, 0, 255))).decode()
    path = write_jsonl(image_dir / "train.jsonl", [
        record(images=["pics/a.png"]),
        record(image=b64),
        record(images=[f"data:image/png;base64,{b64}", "pics/a.png"]),
        record(),
    ])
    examples = read_jsonl(path)
    assert [len(ex.images) for ex in examples] == [1, 1, 2, 0]
    assert examples[0].images[0].size == (56, 28) and examples[1].images[0].size == (28, 56)
    assert examples[1].images[0].convert("RGB").getpixel((0, 0)) == (0, 0, 255)
    # Listed images go in front of the (one) user message's text; a text record is unchanged.
    assert examples[2].messages == ({"role": "user", "content": ({"type": "image"}, {"type": "image"},
                                                                 {"type": "text", "text": "how many?"})},)
    assert examples[2].prompt == "how many?"
    assert examples[3].messages is None and examples[3].images == () and examples[3].prompt == "how many?"


def test_image_parts_place_images_where_the_content_says(image_dir):
    messages = [{"role": "system", "content": "count"},
                {"role": "user", "content": [{"type": "text", "text": "left "}, {"type": "image"},
                                             {"type": "text", "text": " right "}, {"type": "image"}]}]
    ex, = read_jsonl(write_jsonl(image_dir / "d.jsonl", [record(prompt=messages, images=["pics/a.png"] * 2)]))
    assert ex.messages[1]["content"][1] == {"type": "image"} and ex.messages[0]["content"] == "count"
    assert ex.prompt == "count\nleft  right "


def test_a_demonstration_with_image_parts_is_an_image_prompt_and_its_answer(image_dir):
    """TRL's and verl's SFT layout: only ``messages`` (the prompt's user turn with image parts, the
    assistant's answer) and the images; SFT then trains prompt -> answer with the pixels."""
    from polyfsdp.trainer.data.demonstrations import unused_demonstrations_note

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]},
                {"role": "assistant", "content": "2"}]
    ex, = read_jsonl(write_jsonl(image_dir / "sft.jsonl", [{"messages": messages, "images": ["pics/a.png"]}]))
    assert ex.messages == ({"role": "user", "content": ({"type": "image"}, {"type": "text", "text": "how many?"})},)
    assert ex.prompt == "how many?" and ex.answer == "2" and len(ex.images) == 1
    assert unused_demonstrations_note([ex], None) is None  # one exchange: what SFT trains anyway
    encoded = PromptEncoder(CharTokenizer(), processor=tiny_vision_processor(CharTokenizer(), preset_config(
        "qwen2-vl-tiny"))).encode(ex)
    assert encoded.image_grid_thw.tolist() == [[1, 2, 4]] and VLM_TOKENS["image_token_id"] in encoded.prompt_ids


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": [{"type": "text", "text": "2"}]}],
     "field 'messages' message 1 'content' must be text, got list"),
    ([{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "2"},
      {"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "3"}],
     "field 'messages' message 2 holds image parts after the first assistant turn"),
    ([{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "2"}],
     "field 'messages' message 0 part 0 must be"),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}, {"role": "assistant", "content": "2"}],
     "field 'messages' has 2 image parts, but the record gives 1 images"),
])
def test_malformed_image_demonstrations_are_one_line(image_dir, messages, message):
    path = write_jsonl(image_dir / "bad.jsonl", [{"messages": messages, "images": ["pics/a.png"]}])
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path} line 1: ") and message in text, text


def test_multi_turn_conversations_refuse_prompts_with_images(image_dir, tmp_path):
    """A conversation's messages are text: an environment or agent would train without the pixels."""
    from polyfsdp.trainer.errors import ConfigError
    from polyfsdp.trainer.rollout.drivers.multi_turn import MultiTurnDriver, MultiTurnSettings
    from polyfsdp.trainer.rollout.engines import PolicyDecoding
    from polyfsdp.trainer.train import main

    path = write_jsonl(image_dir / "mt.jsonl", [record(), record(images=["pics/a.png"])])
    driver = MultiTurnDriver(PolicyDecoding(), MultiTurnSettings("calculator", {}, 2, None, False), None)
    with pytest.raises(ConfigError, match=r"^rollout.env=calculator: .*mt.jsonl line 2 holds images, and multi-turn "
                                          r"conversations are text only"):
        driver.start(read_jsonl(path), 1, CharTokenizer())
    # The job says it before building any model.
    assert main(["model=qwen2_vl", "data=jsonl", f"data.path={path}", "data.eval_size=1", "rollout.env=calculator",
                 f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    assert not (tmp_path / "out" / "init_model").exists()


def test_parquet_images_as_bytes_and_datasets_structs(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [record(images=[{"bytes": png(), "path": None}], image=None), record(images=None, image=png((56, 56)))]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pyarrow.Table.from_pylist(rows), path)
    examples = read_parquet(path)
    assert [ex.images[0].size for ex in examples] == [(28, 28), (56, 56)]


@pytest.mark.parametrize("fields, message", [
    ({"images": ["pics/missing.png"]}, "line 1: field 'images' item 0: no file"),
    ({"image": base64.b64encode(b"not an image at all").decode()}, "line 1: field 'image' (base64) is not an image"),
    ({"images": [7]}, "line 1: field 'images' item 0 must be a file path, bytes, base64 text"),
    ({"images": "pics/a.png"}, "line 1: field 'images' must be a list of images, got str"),
    ({"images": ["pics/a.png"], "image": "pics/a.png"}, "line 1: has both fields 'images' and 'image'"),
    ({"image": "data:image/png,abc"}, "line 1: field 'image' is a data URL without ';base64'"),
    ({"images": ["pics/a.png"] * 2, "prompt": [{"role": "user", "content": [{"type": "image"}]}]},
     "line 1: field 'prompt' has 1 image parts, but the record gives 2 images"),
    ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]},
     "line 1: field 'prompt' has 1 image parts, but the record gives 0 images"),
    ({"prompt": [{"role": "user", "content": [{"type": "audio"}]}], "images": ["pics/a.png"]},
     "line 1: field 'prompt' message 0 part 0 must be"),
])
def test_malformed_image_fields_are_one_line(image_dir, fields, message):
    path = write_jsonl(image_dir / "bad.jsonl", [{**record(), **fields}])
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(path) and message in text, text


def test_image_record_for_a_text_model_is_one_line(image_dir):
    ex, = read_jsonl(write_jsonl(image_dir / "t.jsonl", [record(images=["pics/a.png"])]))
    with pytest.raises(DataError, match=r"t.jsonl line 1: field 'images': the record has 1 images, but the model has "
                                        r"no image processor"):
        PromptEncoder(CharTokenizer()).encode(ex)


def test_more_images_than_the_template_places_is_one_line(image_dir):
    ex, = read_jsonl(write_jsonl(image_dir / "m.jsonl", [record(images=["pics/a.png"])]))
    processor = tiny_vision_processor(CharTokenizer(), preset_config("qwen2-vl-tiny"))
    processor.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # a template with no image markup
    with pytest.raises(DataError, match=r"m.jsonl line 1: field 'images': the record gives 1 images, but the chat "
                                        r"template wrote 0 image placeholders"):
        PromptEncoder(CharTokenizer(), processor=processor).encode(ex)


def test_tiny_processor_puts_the_config_ids_and_grid_tokens(image_dir):
    tokenizer = CharTokenizer()
    processor = tiny_vision_processor(tokenizer, preset_config("qwen2-vl-tiny"))
    ex, text_ex = read_jsonl(write_jsonl(image_dir / "p.jsonl", [record(images=["pics/a.png"]), record(prompt=[
        {"role": "user", "content": "how many?"}])]))
    encoder = PromptEncoder(tokenizer, processor=processor)
    encoded = encoder.encode(ex)
    image = [VLM_TOKENS["vision_start_token_id"]] + [VLM_TOKENS["image_token_id"]] * 2 + \
        [VLM_TOKENS["vision_end_token_id"]]  # 56x28 pixels: a 2x4 patch grid, 2 tokens after the 2x2 merge
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "how many?"}])
    assert list(encoded.prompt_ids) == chat[:8] + image + chat[8:]
    assert encoded.image_grid_thw.tolist() == [[1, 2, 4]] and tuple(encoded.pixel_values.shape) == (8, 1176)
    # A text prompt of the same run renders as the character tokenizer always did.
    assert list(encoder.encode(text_ex).prompt_ids) == chat


@pytest.mark.parametrize("preset", VLM_PRESETS)
@pytest.mark.parametrize("pad_mode", ["no_padding", "left_right"])
def test_engine_logprobs_on_batches_built_from_image_records(image_dir, preset, pad_mode):
    """Records -> processor -> build_batch -> engine equals HF's forward of each prompt + response alone."""
    (image_dir / "b.png").write_bytes(png((56, 56), (10, 220, 10)))
    records = [record(images=["pics/a.png"]), record(prompt="no image here"),
               record(prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                           {"type": "image"}]}], images=["b.png", "pics/a.png"])]
    tokenizer = CharTokenizer()
    encoder = PromptEncoder(tokenizer, processor=tiny_vision_processor(tokenizer, preset_config(preset)))
    examples = [encoder.encode(ex) for ex in read_jsonl(write_jsonl(image_dir / "e.jsonl", records))]
    responses = [tokenizer.encode("2") + [tokenizer.eos_token_id], tokenizer.encode("abc"), tokenizer.encode("12")]
    batch = build_batch([(ex.prompt_ids, r) for ex, r in zip(examples, responses)], pad_mode,
                        tokenizer.pad_token_id, images=examples)
    assert batch["image_grid_thw"].offsets().tolist() == [0, 1, 1, 3]
    engine = FSDPEngine(ModelConfig(preset=preset, seed=1), EngineConfig(pad_mode=pad_mode)).initialize()
    out = engine.infer_batch(batch)
    reference = vlm_reference_model(preset, full_state_dict(engine.module))
    seqs = [{"ids": torch.tensor(list(ex.prompt_ids) + r),
             "pixels": ex.pixel_values if ex.pixel_values is not None else torch.zeros(0, 1176),
             "grids": ex.image_grid_thw if ex.image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)}
            for ex, r in zip(examples, responses)]
    with torch.no_grad():
        expected, _ = vlm_reference_logprobs(reference, seqs, [1.0] * 3)
    for got, want in zip(per_sequence(out["log_probs"], batch, pad_mode), expected):
        assert (got.double() - want).abs().max().item() <= 1e-5


def test_text_batches_get_no_image_fields():
    batch = build_batch([([1, 5], [6])], "no_padding", 0, images=[None])
    assert set(batch.keys()) == {"input_ids", "response_mask"}
