"""On-policy distillation (``algo.distill``, trainer/algos/distill/): the per-token reverse KL the
RL step adds to the advantages equals a float64 reference computed from both models' logits,
in every pad mode; the config keys' YAML defaults are the dataclass's; a missing teacher, a
directory without a model, a model the engine cannot load and another tokenizer are each one
line naming the key. The toy-task run (a student distilled from an SFT teacher) is
tests/cpu/benchmarks/test_distill_toy_task.py."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from polyfsdp.trainer.config.composition import compose, to_container

from tests.helpers.engine_cases import PRESET, engine_config
from tests.helpers.engine_reference import (full_state_dict, prompt_lengths, reference_logprobs, reference_model, sequences,
                              sharpen_outputs)
from polyfsdp.engines.config import ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.trainer.algos.advantages import sum_on_one_rank
from polyfsdp.trainer.algos.distill.reverse_kl import (ADVANTAGE_SHARE_KEY, REVERSE_KL_KEY, distill_advantages,
                                                       teacher_log_probs)
from polyfsdp.trainer.algos.distill.teacher import check_teacher_tokenizer
from polyfsdp.trainer.algos.updates import old_and_ref_log_probs
from polyfsdp.trainer.config.algo import DistillSection
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.data.batch import build_batch, response_mask
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.train import main
from tests.cpu.trainer.test_cli import TINY
from tests.helpers.vllm_cases import write_checkpoint

TEMPERATURE = 0.7
# (pad_mode, use_remove_padding, max_tokens_per_micro_batch): both layouts, packed and padded
# rows, and micro-batches under a token budget.
MODES = [("no_padding", True, None), ("no_padding", False, 12), ("left_right", True, None),
         ("left_right", False, None)]


def _engine(seed: int, factor: float, mode) -> FSDPEngine:
    pad_mode, remove_padding, budget = mode
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=seed),
                        engine_config(pad_mode=pad_mode, use_remove_padding=remove_padding,
                                      max_tokens_per_micro_batch=budget)).initialize()
    sharpen_outputs(engine.module, factor)  # peaked distributions: a sizeable KL between the two
    return engine


def _float64_reverse_kl(engine_s, engine_t, seqs, temperature):
    """log_softmax(logits / T) of the sampled next tokens, student minus teacher, from plain
    HF models in float64 (one sequence at a time)."""
    out = []
    with torch.no_grad():
        student, teacher = (reference_model(PRESET, full_state_dict(e.module)).double() for e in (engine_s, engine_t))
        lp_s, _ = reference_logprobs(student, seqs, [temperature] * len(seqs))
        lp_t, _ = reference_logprobs(teacher, seqs, [temperature] * len(seqs))
    for s, t in zip(lp_s, lp_t):
        out.append(s - t)
    return out


@pytest.mark.parametrize("mode", MODES, ids=["-".join(map(str, m)) for m in MODES])
def test_per_token_reverse_kl_equals_a_float64_reference_on_logits(mode):
    pad_mode = mode[0]
    student, teacher = _engine(3, 4.0, mode), _engine(8, 2.0, mode)
    seqs = sequences([7, 5, 11, 6, 9, 4], seed=11)
    pairs = [(s[:p].tolist(), s[p:].tolist()) for s, p in zip(seqs, prompt_lengths(seqs))]
    batch = build_batch(pairs, pad_mode, 0)
    masks = [response_mask(*pair) for pair in pairs]
    # The RL step's own calls: the student's old log-probs, the teacher's pass, the mixing.
    old, _ = old_and_ref_log_probs(student, None, batch, TEMPERATURE, True, {})
    taught = teacher_log_probs(teacher, batch, TEMPERATURE, pad_mode)
    task = [torch.full((len(m),), 0.25 * (i % 3 - 1)) for i, m in enumerate(masks)]
    mixed, metrics = distill_advantages(task, masks, old, taught, coef=1.5, task_weight=2.0,
                                        sum_over_ranks=sum_on_one_rank)

    reference = _float64_reverse_kl(student, teacher, seqs, TEMPERATURE)
    on = torch.cat(masks).bool()
    kl_ref = torch.cat(reference)[on]
    assert kl_ref.abs().max() > 0.5, "the two models must disagree well beyond the tolerance"
    kl_got = (torch.cat([2.0 * a for a in task]) - torch.cat(mixed)).double()[on] / 1.5
    assert (kl_got - kl_ref).abs().max().item() <= 1e-5
    # Off the response the advantage is the task's alone.
    assert torch.equal(torch.cat(mixed)[~on], torch.cat([2.0 * a for a in task])[~on])
    assert metrics[REVERSE_KL_KEY] == pytest.approx(kl_ref.mean().item(), abs=1e-6)
    kl_part, task_part = 1.5 * kl_ref.abs().sum().item(), torch.cat([2.0 * a for a in task])[on].abs().sum().item()
    assert metrics[ADVANTAGE_SHARE_KEY] == pytest.approx(kl_part / (kl_part + task_part), rel=1e-5)
    # Negative control: the teacher at temperature 1 (not the sampling one) is another KL.
    lp_t1 = _float64_reverse_kl(student, teacher, seqs, 1.0)
    assert (torch.cat(lp_t1)[on] - kl_ref).abs().max().item() > 100 * 1e-5


def test_the_yaml_defaults_are_the_dataclass_defaults():
    distill = to_container(compose([]))["algo"]["distill"]
    assert distill == {f.name: f.default for f in dataclasses.fields(DistillSection)}
    assert load_config([]).algo.distill == DistillSection()


def _one_line(exc_info, start: str) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and text.startswith(start), text
    return text


def test_a_missing_teacher_or_one_without_a_model_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config([f"algo.distill.teacher={tmp_path / 'nowhere'}"])
    assert "is not a directory" in _one_line(info, "algo.distill.teacher: ")
    with pytest.raises(ConfigError) as info:
        load_config([f"algo.distill.teacher={tmp_path}"])
    assert "holds no model (no config.json)" in _one_line(info, "algo.distill.teacher: ")
    with pytest.raises(ConfigError) as info:
        load_config(["algo=sft", f"+algo.distill.teacher={tmp_path}"])
    _one_line(info, "algo.distill.teacher: distillation trains on the RL phase's samples")
    for override in ("algo.distill.coef=-1", "algo.distill.task_weight=-0.5"):
        with pytest.raises(ConfigError) as info:
            load_config([override])
        _one_line(info, override.split("=")[0] + ": expected >= 0")


def _teacher_dir(path: Path, tokenizer) -> str:
    write_checkpoint(path, "qwen2-tiny", tokenizer, seed=5)
    tokenizer.save_pretrained(str(path))
    return str(path)


def test_another_tokenizer_is_refused_in_one_line_naming_both_and_the_first_differing_token(tmp_path):
    ours = CharTokenizer()
    check_teacher_tokenizer(_teacher_dir(tmp_path / "same", CharTokenizer()), ours, "the student's")  # accepted
    swapped = CharTokenizer("ba" + CharTokenizer().chars[2:])
    teacher = _teacher_dir(tmp_path / "other", swapped)
    with pytest.raises(ConfigError) as info:
        check_teacher_tokenizer(teacher, ours, "STUDENT_DIR")
    text = _one_line(info, "algo.distill.teacher: the teacher's tokenizer")
    assert teacher in text and "STUDENT_DIR" in text and "token id 4 is 'b' in the teacher's, 'a' in the student's" \
        in text
    # One more token at the end: the first difference is an id the student lacks.
    longer = _teacher_dir(tmp_path / "longer", CharTokenizer(CharTokenizer().chars + "~"))
    with pytest.raises(ConfigError) as info:
        check_teacher_tokenizer(longer, ours, "STUDENT_DIR")
    assert f"token id {len(ours.vocab)} is '~' in the teacher's, absent in the student's" in _one_line(
        info, "algo.distill.teacher:")


def _stderr_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_job_refuses_another_tokenizer_and_an_unloadable_teacher_in_one_line(tmp_path, capsys):
    run = [*TINY, "algo.actor.group_size=4", "trainer.sft_steps=0", "trainer.plot=false",
           "trainer.checkpoint_interval=0"]
    other = _teacher_dir(tmp_path / "other", CharTokenizer("ba" + CharTokenizer().chars[2:]))
    capsys.readouterr()  # the checkpoint's progress bars
    assert main([*run, f"algo.distill.teacher={other}", f"trainer.output_dir={tmp_path / 'a'}"]) != 0
    line = _stderr_line(capsys)
    assert "algo.distill.teacher: the teacher's tokenizer" in line and other in line
    assert not (tmp_path / "a" / "init_model").exists(), "refused before any model is built"
    broken = Path(_teacher_dir(tmp_path / "broken", CharTokenizer()))
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model"}))
    capsys.readouterr()
    assert main([*run, f"algo.distill.teacher={broken}", f"trainer.output_dir={tmp_path / 'b'}"]) != 0
    assert f"algo.distill.teacher ({broken}): " in _stderr_line(capsys)
    # A reward model's checkpoint (a classifier, no LM head): transformers would draw the head at random.
    classifier = tmp_path / "classifier"
    write_checkpoint(classifier, "qwen2-tiny", CharTokenizer(), seed=5, tie_word_embeddings=False)
    config = json.loads((classifier / "config.json").read_text())
    state_file = classifier / "model.safetensors"
    from safetensors.torch import load_file, save_file

    state = load_file(str(state_file))
    state["score.weight"] = state.pop("lm_head.weight")[:1]
    save_file(state, str(state_file))
    (classifier / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForSequenceClassification"],
                                                        "num_labels": 1}))
    CharTokenizer().save_pretrained(str(classifier))
    capsys.readouterr()
    assert main([*run, f"algo.distill.teacher={classifier}", f"trainer.output_dir={tmp_path / 'c'}"]) != 0
    line = _stderr_line(capsys)
    assert f"algo.distill.teacher ({classifier}): " in line and "lm_head.weight is missing; the checkpoint is " \
        "Qwen2ForSequenceClassification" in line, line


def test_a_teacher_whose_weights_are_not_its_config_is_one_line_before_training(tmp_path, capsys):
    """The teacher engine is built when the RL phase starts: its weights are checked against its
    config.json before the SFT phase trains (TINY has 2 SFT steps)."""
    run = [*TINY, "algo.actor.group_size=4", "trainer.plot=false", "trainer.checkpoint_interval=0"]
    vocab = len(CharTokenizer().vocab)
    for name, edit, expected in [
            ("wider", {"vocab_size": vocab + 7},
             f"lm_head.weight is [{vocab}, 64] in the weights, but its config.json builds it as [{vocab + 7}, 64]"),
            ("fewer_layers", {"num_hidden_layers": 1, "layer_types": ["full_attention"]},
             "the weights hold 12 tensor(s) its config.json does not build: model.layers.1.")]:
        teacher = tmp_path / name
        write_checkpoint(teacher, "qwen2-tiny", CharTokenizer(), seed=5, tie_word_embeddings=False)
        CharTokenizer().save_pretrained(str(teacher))
        config = json.loads((teacher / "config.json").read_text())
        (teacher / "config.json").write_text(json.dumps({**config, **edit}))
        out = tmp_path / f"run_{name}"
        capsys.readouterr()
        assert main([*run, f"algo.distill.teacher={teacher}", f"trainer.output_dir={out}"]) != 0
        line = _stderr_line(capsys)
        assert line.startswith(f"polyfsdp-train: error: algo.distill.teacher: the teacher's weights ({teacher}) are "
                               f"not the model its config.json describes: {expected}"), line
        assert not (out / "init_model").exists() and not (out / "sft_model").exists(), "refused before training"


def test_the_estimate_counts_the_teacher_as_a_frozen_copy_with_its_own_pass(tmp_path):
    from polyfsdp.trainer.run.estimate import estimate_job

    teacher = _teacher_dir(tmp_path / "teacher", CharTokenizer())
    plain = estimate_job(load_config(["model.lora.rank=4"]), 1)
    taught = estimate_job(load_config(["model.lora.rank=4", f"algo.distill.teacher={teacher}"]), 1)
    assert "teacher parameters (a frozen copy)" not in plain.state["grpo"]
    # write_checkpoint's sizes (hidden 64, the default vocabulary), all frozen, no adapters.
    assert taught.state["grpo"]["teacher parameters (a frozen copy)"] > 0
    assert [s.name for s in taught.steps["grpo"]] == [s.name for s in plain.steps["grpo"][:2]] + \
        ["teacher log-prob pass (no grad)"] + [s.name for s in plain.steps["grpo"][2:]], \
        [s.name for s in taught.steps["grpo"]]
