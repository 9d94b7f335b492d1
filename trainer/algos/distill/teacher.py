"""The teacher of on-policy distillation (``algo.distill.teacher``): a Hugging Face checkpoint
directory, frozen and sharded like the KL reference (a second engine the job builds; never
LoRA, whatever the student's ``model.lora``).

Its log-probs are compared with the student's token by token, so both must share one
vocabulary (the same token string at every id): :func:`check_teacher_tokenizer` refuses
another one in one line naming both sources and the first id where they differ, before any
model is built. A missing directory or one without a model is refused at config time
(``DistillSection.validate``); weights that are not the model its config.json describes (another
hidden size or vocabulary, layers missing or extra) are refused by :func:`check_teacher_weights`
before training (the teacher engine is built when the RL phase starts, after any SFT); any other
model the engine cannot load is one line naming the key when the job builds it.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from polyfsdp.engines.config import LoraConfig

from ...data.tokenizers import load_tokenizer
from ...errors import ConfigError

KEY = "algo.distill.teacher"


def vocabulary(tokenizer) -> list[str]:
    """The token string of every id: the character tokenizer's list, a Hugging Face tokenizer's
    ids converted (added tokens included)."""
    if hasattr(tokenizer, "vocab"):
        return list(tokenizer.vocab)
    hf = tokenizer.tok
    return [str(token) for token in hf.convert_ids_to_tokens(list(range(len(hf))))]


def check_teacher_tokenizer(teacher_dir: str, student_tokenizer, student_source: str) -> None:
    """One ConfigError when the teacher's tokenizer is missing or has another vocabulary than
    the student's (``student_source`` names where the student's comes from), or when the
    teacher's model has fewer embedding rows than the vocabulary."""
    try:
        teacher_tokenizer = load_tokenizer(teacher_dir, key=KEY)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    theirs, ours = vocabulary(teacher_tokenizer), vocabulary(student_tokenizer)
    if theirs != ours:
        first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        say = lambda vocab: repr(vocab[first]) if first < len(vocab) else "absent"  # noqa: E731
        raise ConfigError(f"{KEY}: the teacher's tokenizer ({teacher_dir}, {len(theirs)} tokens) is not the "
                          f"student's ({student_source}, {len(ours)} tokens): token id {first} is {say(theirs)} "
                          f"in the teacher's, {say(ours)} in the student's; distillation compares log-probs id by "
                          f"id, so the teacher needs the student's tokenizer")
    rows = json.loads((Path(teacher_dir) / "config.json").read_text()).get("vocab_size")
    if isinstance(rows, int) and rows < len(ours):
        raise ConfigError(f"{KEY}: the teacher's model ({teacher_dir}) has vocab_size {rows}, fewer than its "
                          f"tokenizer's {len(ours)} tokens; it cannot score every token the student samples")


def check_teacher_weights(teacher_dir: str) -> None:
    """One ConfigError naming ``teacher_dir`` and the first tensor whose stored shape is not the
    one its config.json builds (or the tensors missing or extra), read from the weights' headers
    and a meta-device model: no weights are loaded."""
    from polyfsdp.engines.model.builder import auto_class_for, read_hf_config
    from polyfsdp.engines.model.weights_fit import weights_mismatch
    from transformers import AutoModelForCausalLM

    try:
        hf_config = read_hf_config(teacher_dir)
    except ValueError as exc:
        raise ConfigError(f"{KEY} ({teacher_dir}): {exc}") from None
    mismatch = weights_mismatch(teacher_dir, hf_config, auto_class_for(hf_config, AutoModelForCausalLM))
    if mismatch:
        raise ConfigError(f"{KEY}: the teacher's weights ({teacher_dir}) are not the model its config.json "
                          f"describes: {mismatch}; use the config.json saved with these weights")


def teacher_model_config(model_section, teacher_dir: str):
    """The teacher engine's ModelConfig: the student's dtype and attention, the teacher's
    weights, no adapters (it never trains)."""
    return replace(model_section.model_config(path=teacher_dir), lora=LoraConfig())


def teacher_memory(cfg, world_size: int) -> dict:
    """``{"teacher": ModelMemory}`` of ``--estimate`` (a frozen copy sharded like the
    reference), or ``{}`` without a teacher."""
    if not cfg.algo.rl or cfg.algo.distill.teacher is None:
        return {}
    from polyfsdp.engines.memory import ModelMemory, hf_config_of

    model_config = teacher_model_config(cfg.model, cfg.algo.distill.teacher)
    return {"teacher": ModelMemory(model_config, cfg.engine, world_size, hf_config_of(model_config))}
