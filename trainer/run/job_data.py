"""What a job reads before it builds a model: the tokenizer, the data source and the token budgets.

:func:`load_job_data` loads them on every rank, and checks (with one line naming the fix) that the
tokenizer covers the data, that the data's prompts leave room for the completions, that
prompt plus completion fit the model's positions, and that a distillation teacher shares the
tokenizer (trainer/algos/distill/teacher.py).
"""
from __future__ import annotations

from pathlib import Path

from ..data.chat import PromptEncoder, check_position_budget, model_max_positions
from ..config.sections import JobConfig
from ..data.sources import build_source, check_generation_budget, check_tokenizer_covers, max_answer_tokens
from ..data.demonstrations import unused_demonstrations_note
from ..errors import ConfigError
from ..rank_errors import check_same_data, on_every_rank
from ..data.tokenizers import TOKENIZER_FILE, load_tokenizer
from ..algos.distill.teacher import check_teacher_tokenizer, check_teacher_weights


def job_processor(cfg: JobConfig, tokenizer):
    """The vision-language model's processor (trainer/data/vision.py): a checkpoint's own, or
    for a preset its family's built around the character tokenizer; None for a text model."""
    from ..data.vision import load_processor, tiny_vision_processor

    if cfg.model.path:
        try:
            return load_processor(cfg.model.path)
        except Exception as exc:  # noqa: BLE001 - unreadable processor files: one line naming them
            raise ConfigError(f"model.path={cfg.model.path}: its processor cannot be loaded: "
                              f"{' '.join(str(exc).split())[:200]}") from None
    from polyfsdp.engines.presets import preset_config

    config = preset_config(cfg.model.preset, **dict(cfg.model.overrides))
    return tiny_vision_processor(tokenizer, config) if getattr(config, "vision_config", None) is not None else None


def job_encoder(cfg: JobConfig, tokenizer, grow_vocabulary: bool) -> PromptEncoder:
    """The job's prompt encoder (trainer/data/chat.py), with the model's processor for prompts
    with images (built at first use: a preset's wraps the tokenizer once it knows the data)."""
    return PromptEncoder(tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_length, cfg.data.overlong,
                         cfg.model.path, grow_vocabulary=grow_vocabulary,
                         processor_factory=lambda: job_processor(cfg, tokenizer))


def load_job_data(cfg: JobConfig, out: Path, rank: int, say) -> tuple:
    """``(tokenizer, source, eval_tokens)`` of the job writing to ``out``: ``eval_tokens`` is the
    evaluation's completion budget (the actor's, or the longest answer's for algo=sft)."""
    # A preset's character tokenizer: the one the run's initial model was built with, when
    # it exists (a continued run); else a fresh one that learns the data's characters.
    saved = out / "init_model" / TOKENIZER_FILE
    tokenizer_dir = cfg.model.path or (str(saved.parent) if saved.is_file() else None)
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    encoder = job_encoder(cfg, tokenizer, grow_vocabulary=tokenizer_dir is None)
    # A file missing on one rank stops every rank; then all must have read the same records.
    source = on_every_rank(lambda: build_source(cfg.data, cfg.trainer.seed, encoder, cfg.rollout))
    check_same_data(source, cfg.data)
    if cfg.rollout.env or cfg.rollout.agent:  # before any model is built: its conversations are text
        from ..rollout.drivers.result import refuse_images

        key = "rollout.agent" if cfg.rollout.agent else "rollout.env"
        refuse_images([*getattr(source, "train_examples", ()), *getattr(source, "eval_examples", ())], key,
                      cfg.rollout.agent or cfg.rollout.env)
    note = unused_demonstrations_note(getattr(source, "train_examples", ()), cfg.rollout.env)
    if note:
        say(note)
    if encoder.added_characters:
        say(f"character tokenizer: added the data's characters {encoder.added_characters!r} to its "
            f"vocabulary ({tokenizer.vocab_size} tokens)")
    if tokenizer_dir == str(saved.parent):
        check_tokenizer_covers(source, tokenizer,
                               fix=f"this run's initial model ({saved.parent}) was built for the characters of "
                                   f"the data it started with: continue with that data, or start a new "
                                   f"trainer.output_dir")
    else:
        check_tokenizer_covers(source, tokenizer)
    if cfg.algo.rl and cfg.algo.distill.enabled:
        # After the source: a preset's character tokenizer has learnt the data's characters by now.
        check_teacher_tokenizer(cfg.algo.distill.teacher, tokenizer, tokenizer_dir or
                                f"the character tokenizer of model.preset={cfg.model.preset} on this data")
        check_teacher_weights(cfg.algo.distill.teacher)
    actor = cfg.algo.actor
    if actor is not None:
        # Rank 0 checks; the others learn its verdict instead of waiting for it in a collective.
        on_every_rank(lambda: check_generation_budget(source, tokenizer, actor.max_new_tokens)
                      if rank == 0 else None)
    eval_tokens = actor.max_new_tokens if actor is not None else \
        max_answer_tokens(source, tokenizer) + 2
    check_position_budget(source, model_max_positions(cfg.model), eval_tokens,
                          "algo.actor.max_new_tokens" if actor is not None else "the longest answer")
    return tokenizer, source, eval_tokens
