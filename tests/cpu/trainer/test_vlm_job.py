"""Vision-language jobs through ``polyfsdp-train`` (docs/vision-language.md): the built-in visual
task ``data.task=count_squares`` (its images and answers), and an SFT + GRPO job on the tiny
Qwen2-VL preset that runs end to end with every trained and sampled batch carrying the
prompts' pixels; an image record for a text model is one line."""
from __future__ import annotations

import json
import random
import warnings

import numpy
import pytest

from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.trainer.data.count_squares import QUESTION, SQUARE, CountSquaresTask
from polyfsdp.trainer.data.sources import build_source
from polyfsdp.trainer.rollout import decode as decode_module
from polyfsdp.trainer.train import main
from polyfsdp.trainer.tracking.metrics import read_metrics

warnings.filterwarnings("ignore", message=".*torchvision.*")
TINY = ["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=4", "trainer.prompts_per_step=2",
        "algo.actor.group_size=2", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
        "trainer.checkpoint_interval=0", "data.eval_size=4", "algo.actor.max_new_tokens=3"]


def test_count_squares_images_hold_as_many_squares_as_the_answer_says():
    task = CountSquaresTask()
    rng = random.Random(0)
    for _ in range(20):
        ex = task.sample(rng)
        image, = ex.images
        assert image.size == (56, 56) and ex.prompt == QUESTION and ex.data_source == "count_squares"
        coloured = int((numpy.asarray(image) != 255).any(-1).sum())
        assert coloured == SQUARE * SQUARE * int(ex.answer)  # squares in separate cells
        assert ex.messages[0]["content"][0] == {"type": "image"}
    assert task.distinct_prompts > 10_000


def test_held_out_drawings_are_never_trained_on():
    from polyfsdp.trainer.config.sections import DataSection

    source = build_source(DataSection(task="count_squares", eval_size=16), seed=1)
    held_out = {ex.where for ex in source.eval_examples}
    assert len(held_out) == 16
    trained = {ex.where for step in range(20) for ex in source.batch("grpo", step, 8)}
    assert not held_out & trained


@pytest.mark.parametrize("preset", ["qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def test_sft_and_grpo_job_on_a_tiny_vlm_runs_with_images(tmp_path, monkeypatch, preset):
    trained, sampled = [], []
    train_batch, decode = FSDPEngine.train_batch, decode_module.decode

    def spy_train(self, batch, *args, **kwargs):
        trained.append("pixel_values" in batch.keys() and batch["image_grid_thw"].values().shape[0])
        return train_batch(self, batch, *args, **kwargs)

    def spy_decode(model, ids, mask, params, row_seeds=None, images=None):
        sampled.append(images is not None and all(x.pixel_values is not None for x in images))
        return decode(model, ids, mask, params, row_seeds, images)

    monkeypatch.setattr(FSDPEngine, "train_batch", spy_train)
    monkeypatch.setattr(decode_module, "decode", spy_decode)
    out = tmp_path / "run"
    assert main([*TINY, "model=qwen2_vl", f"model.preset={preset}", "data.task=count_squares",
                 f"trainer.output_dir={out}"]) == 0
    # 2 SFT steps of 4 images, 2 GRPO updates of 2 prompts x 2 completions; every rollout with images.
    assert trained == [4, 4, 4, 4] and sampled and all(sampled)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["phase"] for r in records if r["phase"] in ("sft", "rl")] == ["sft", "sft", "rl", "rl"]
    config = json.loads((out / "init_model" / "config.json").read_text())
    assert config["model_type"] == preset.removesuffix("-tiny").replace("-", "_").replace(".", "_")
    assert config["image_token_id"] == 126


def test_image_records_for_a_text_model_are_one_line(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (28, 28), (255, 0, 0)).save(tmp_path / "red.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": "colour?", "answer": "red", "images": ["red.png"]}) + "\n"
                            for _ in range(3)))
    code = main([*TINY, "data=jsonl", f"data.path={path}", "data.eval_size=1", f"trainer.output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code != 0
    assert f"{path} line 1: field 'images': the record has 1 images, but the model has no image processor" in err


def test_estimate_counts_the_image_tokens_and_builds_the_vision_model():
    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.data.tokenizers import CharTokenizer
    from polyfsdp.trainer.run.estimate import _Lengths, estimate_job

    cfg = load_config(["model=qwen2_vl", "data.task=count_squares", "trainer.rl_steps=1", "trainer.sft_steps=1"])
    lengths = _Lengths(cfg)
    ex = lengths.source.eval_examples[0]
    text_only = len(CharTokenizer().apply_chat_template([{"role": "user", "content": QUESTION}]))
    assert lengths.prompt(ex) == text_only + 1 + 4 + 1  # vision start, a 56x56 image's 4 tokens, vision end
    assert "peak over phases" in estimate_job(cfg, 1).table()


def test_estimate_counts_the_towers_activations_for_the_micro_batchs_patches():
    """count_squares: 16 patches (4 image tokens x merge^2) per prompt; the update, the log-prob
    pass and generation count the tower over every row's patches."""
    from polyfsdp.engines.memory import ModelMemory
    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.run.estimate import _hf_config, _largest, _Lengths, estimate_job

    cfg = load_config(["model=qwen2_vl", "data.task=count_squares", "trainer.rl_steps=1", "trainer.sft_steps=1"])
    lengths = _Lengths(cfg)
    assert {lengths.patches(ex) for ex in lengths.source.eval_examples} == {16}
    policy = ModelMemory(cfg.model.model_config(), cfg.engine, 1, _hf_config(cfg, lengths.tokenizer))
    steps = {s.name: s for s in estimate_job(cfg, 1).steps["grpo"]}
    update, ref = steps["actor update micro-batch"], steps["old/ref log-prob pass (no grad)"]
    entropy = cfg.algo.actor_loss(cfg.trainer.prompts_per_step).requires_entropy
    assert update.transient == policy.grads + policy.train_step(update.tokens, entropy, patches=16 * update.rows)
    assert update.transient - policy.grads - policy.train_step(update.tokens, entropy) >= \
        policy.tower.saved(16 * update.rows) > 0
    assert ref.transient == policy.inference(ref.tokens, patches=16 * ref.rows)
    # Under a budget the image-heavy micro-batch of fewer tokens is the largest when it costs more.
    sequences = [[(10, 0), (6, 100)]]
    assert _largest(sequences, 10, True) == (1, 10, 0) == _largest([[(10, 0), (6, 0)]], 10, True, lambda t, p: t + p)
    assert _largest(sequences, 10, True, lambda t, p: t + p) == (1, 6, 100)


def test_export_holds_the_processor_and_a_job_continues_from_it(tmp_path):
    from PIL import Image

    from polyfsdp.engines.config import ModelConfig
    from polyfsdp.engines.presets import preset_config
    from polyfsdp.trainer.data.tokenizers import load_tokenizer
    from polyfsdp.trainer.data.vision import load_processor, tiny_vision_processor

    first = tmp_path / "first"
    args = [a for a in TINY if not a.startswith("trainer.export")]
    assert main([*args, "model=qwen2_vl", "data.task=count_squares", "trainer.export=true",
                 f"trainer.output_dir={first}"]) == 0
    final = first / "final"
    processor = load_processor(str(final))
    assert processor is not None and load_processor(str(first / "init_model")) is None
    tokenizer = load_tokenizer(str(final))  # the character tokenizer, as before
    built = tiny_vision_processor(tokenizer, preset_config("qwen2-vl-tiny"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    image = Image.new("RGB", (56, 28), (9, 9, 200))
    outs = [p(text=[p.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)], images=[image],
              return_tensors="pt", add_special_tokens=False) for p in (processor, built)]
    assert outs[0]["input_ids"].tolist() == outs[1]["input_ids"].tolist()
    assert (outs[0]["pixel_values"] - outs[1]["pixel_values"]).abs().max() == 0
    assert ModelConfig(path=str(final)).path  # an ordinary checkpoint directory
    # A new run from the export (model.path): its processor and character tokenizer are the export's.
    assert main([*args, "trainer.sft_steps=0", f"model.path={final}", "data.task=count_squares",
                 f"trainer.output_dir={tmp_path / 'second'}"]) == 0


@pytest.mark.parametrize("staleness", [0, 1])
def test_resume_after_sigkill_continues_the_same_curve(tmp_path, staleness):
    """With rollout.max_staleness=1 the checkpoint also holds the next step's batch, sampled ahead
    with its images: their pixel inputs are saved and trained on after the resume."""
    import subprocess
    import sys

    from tests.helpers.kill_at_checkpoint import kill_after_checkpoint

    args = [a for a in TINY if not a.startswith(("trainer.checkpoint_interval", "trainer.rl_steps"))]
    overrides = [*args, "model=qwen2_vl", "data.task=count_squares", "trainer.rl_steps=4",
                 "trainer.checkpoint_interval=2", "algo.actor.temperature=1.0", f"rollout.max_staleness={staleness}"]
    assert main([*overrides, f"trainer.output_dir={tmp_path / 'full'}"]) == 0
    reference = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))
    out = tmp_path / "killed"
    proc, seen = kill_after_checkpoint([*overrides, f"trainer.output_dir={out}"])
    assert proc.returncode < 0, "".join(seen)
    resumed = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *overrides, f"trainer.output_dir={out}",
                              "trainer.resume=auto"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resuming rl from" in resumed.stdout, resumed.stderr[-2000:]
    timing = ("time_s", "step_time_s", "tokens_per_s", "gen_time_s", "weight_sync_time_s")
    comparable = lambda records: [{k: v for k, v in r.items() if k not in timing and not k.endswith("_s")}  # noqa: E731
                                  for r in records]
    assert comparable(read_metrics(str(out / "metrics.jsonl"))) == comparable(reference)


def test_a_rollout_engine_without_images_refuses_image_prompts_in_one_line():
    import torch

    from polyfsdp.trainer.data.example import Example
    from polyfsdp.trainer.data.tokenizers import CharTokenizer
    from polyfsdp.trainer.errors import ConfigError
    from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver
    from polyfsdp.trainer.rollout.engines import RolloutEngine, SamplingParams

    class TextOnly(RolloutEngine):
        name = "my_engine"

    ex = Example(prompt="q", answer="1", prompt_ids=(1, 5), pixel_values=torch.zeros(4, 1176),
                 image_grid_thw=torch.tensor([[1, 2, 2]]))
    with pytest.raises(ConfigError, match=r"^rollout.engine=my_engine: this engine takes no images; prompts with "
                                          r"images are sampled by rollout.engine=builtin, hf, auto, vllm or vllm_server"):
        SingleTurnDriver(TextOnly()).rollout(CharTokenizer(), [ex], 2, SamplingParams(4, stop_token_ids=(2,)))


def test_a_vision_language_preset_under_a_text_presets_overrides_is_one_line_naming_the_fix():
    """The default model group's overrides (a text preset's head) break the mrope sections in the
    forward; the configuration check says so before any work, and model=qwen2_vl fits."""
    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.overrides: give qwen2-vl-tiny a head of 24 .* mrope sections "
                                          r"\[1, 1, 2\] need 8; .* use model=qwen2_vl"):
        load_config(["model.preset=qwen2-vl-tiny"])
    for preset in ("qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny"):
        assert load_config(["model=qwen2_vl", f"model.preset={preset}"]).model.preset == preset


def test_the_count_squares_task_preset_is_the_measured_command():
    """docs/vision-language.md's table was measured with these settings; task=count_squares is them."""
    from polyfsdp.trainer.config.job import load_config

    cfg = load_config(["task=count_squares"])
    assert (cfg.model.preset, cfg.model.freeze_vision, cfg.data.task) == ("qwen2-vl-tiny", True, "count_squares")
    assert (cfg.trainer.sft_steps, cfg.trainer.rl_steps) == (100, 100)
