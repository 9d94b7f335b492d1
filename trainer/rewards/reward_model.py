"""``reward.model``: a local reward model scoring each record's prompt + completion, as one
source of the weighted reward (trainer/rewards/sources.py).

The model is an infer-only FSDPEngine with a score head (engines/head/score.py: a
``*ForSequenceClassification`` checkpoint with num_labels=1, or a causal LM with a value head
file), sharded like the reference model and batched by ``reward.model.max_tokens_per_batch``.
What it reads:

- its tokenizer equals the policy's (same vocabulary, same chat template) and ``template=auto``:
  the policy's own ids, prompt + sampled completion, passed through;
- otherwise text, re-tokenized with its own tokenizer: ``chat`` (``auto`` when its tokenizer has
  a chat template) renders the record's messages (a string prompt as one user message) plus the
  completion as an assistant message; ``none`` is ``<bos>`` + the prompt text + the completion.

The score is the model's output at the sequence's last token (Hugging Face's convention).
A record that does not fit the model (more tokens than its ``max_position_embeddings``, an id its
embedding lacks) is one RewardError naming the source and the record; every rank still runs the
forward first (FSDP's collectives pair up), then the error reaches every rank.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..data.batch import build_batch
from ..data.chat import example_prompt_tokens, text_prompt_tokens
from ..errors import ConfigError, RewardError


def same_tokenizer(a, b) -> bool:
    """Whether two trainer tokenizers (trainer/data/tokenizers.py) map text to the same ids and
    render chats alike: the same vocabulary, special tokens and chat template."""
    def fingerprint(tok):
        hf = getattr(tok, "tok", None)
        if hf is not None:
            return ("hf", hf.get_vocab(), getattr(hf, "chat_template", None), tok.bos_token_id, tok.eos_token_id)
        return (type(tok).__name__, tuple(getattr(tok, "vocab", ())), tok.bos_token_id, tok.eos_token_id)
    return fingerprint(a) == fingerprint(b)


class RewardModelSource:
    """A reward model as a source: ``score_all`` scores every row with one ``infer_scores`` call
    (on every rank, with a stand-in row when a rank has none)."""

    collective = True

    def __init__(self, section, engine, tokenizer, policy_tokenizer, pad_mode: str) -> None:
        self.name, self.weight, self.data_sources = section.name, section.weight, section.data_sources
        self.engine, self.tokenizer, self.pad_mode = engine, tokenizer, pad_mode
        self.label = f"reward.model ({section.name}, {section.path})"
        has_template = bool(getattr(tokenizer, "has_chat_template", False))
        if section.template == "chat" and not has_template:
            raise ConfigError(f"reward.model.template=chat: the tokenizer of {section.path} has no chat template; "
                              f"add one to its tokenizer_config.json or set reward.model.template=none")
        self.chat = section.template == "chat" or (section.template == "auto" and has_template)
        self.pass_through = section.template == "auto" and same_tokenizer(tokenizer, policy_tokenizer)
        self.policy_tokenizer = policy_tokenizer
        self.vocab = engine.module.get_input_embeddings().num_embeddings
        self.max_positions = getattr(engine.module.config, "max_position_embeddings", None)
        how = "the policy's ids" if self.pass_through else ("chat text" if self.chat else "plain text")
        self.title = f"{self.name} ({section.path}, {how})"  # the run's first line names it so

    def sequence(self, example, text: str, response_ids) -> tuple[list[int], list[int]]:
        """``(prompt ids, completion ids)`` of one row for the reward model."""
        if self.pass_through:
            return example_prompt_tokens(self.policy_tokenizer, example), list(response_ids)
        tok = self.tokenizer
        if not self.chat:
            return text_prompt_tokens(tok, example.prompt) or [tok.pad_token_id], tok.encode(text)
        messages = list(example.messages) if example.messages else [{"role": "user", "content": example.prompt}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        full = tok.apply_chat_template(messages + [{"role": "assistant", "content": text}], add_generation_prompt=False)
        # The split only places the rows in left_right's layout; a template that renders the
        # prompt differently inside the whole chat keeps the whole sequence as one part.
        cut = len(prompt) if full[:len(prompt)] == prompt and prompt else 1
        return full[:cut], full[cut:]

    def _check(self, ids: list[int], record: str) -> None:
        if self.max_positions is not None and len(ids) > self.max_positions:
            raise RewardError(f"{self.label}: record {record} is {len(ids)} tokens for the reward model, more than "
                              f"its max_position_embeddings={self.max_positions}")
        bad = next((i for i in ids if not 0 <= i < self.vocab), None)
        if bad is not None:
            raise RewardError(f"{self.label}: record {record} has token id {bad}, outside the reward model's "
                              f"embedding ({self.vocab} rows): its tokenizer does not match its weights")

    def score_all(self, examples, texts, responses, group: int = 1):
        """One score per row (row ``i`` answers ``examples[i // group]``), no extras."""
        pairs, error = [], None
        for i, (text, ids) in enumerate(zip(texts, responses)):
            example = examples[i // group]
            record = example.where or f"with prompt {example.prompt!r}"
            try:
                prompt, completion = self.sequence(example, text, ids)
                self._check(prompt + completion, record)
            except RewardError as exc:
                error = error or exc
                continue
            except Exception as exc:  # noqa: BLE001 - a template or tokenizer failing on this record
                error = error or RewardError(f"{self.label}: record {record}: {type(exc).__name__}: "
                                             f"{' '.join(str(exc).split())[:200]}")
                continue
            pairs.append((prompt, completion))
        # Every rank runs its forward (a stand-in row when it has nothing, or failed), then reports.
        runs = pairs if pairs and error is None else [([0], [])]
        scores = self.engine.infer_scores(build_batch(runs, self.pad_mode, self.tokenizer.pad_token_id)).tolist()
        if error is not None:
            raise error
        scores = scores if pairs else []
        for i, score in enumerate(scores):
            if not math.isfinite(score):
                example = examples[i // group]
                raise RewardError(f"{self.label}: scored {score} for record {example.where or repr(example.prompt)}")
        return scores, {}


def build_reward_model_source(section, cfg, policy_tokenizer, backend) -> RewardModelSource:
    """The engine (infer-only, the job's modes, no sequence parallelism, the section's token budget
    and offload) and tokenizer of ``reward.model``; one-line ConfigErrors when they do not load."""
    from polyfsdp.engines.config import ModelConfig
    from polyfsdp.engines.engine import FSDPEngine

    from ..data.tokenizers import load_tokenizer

    try:
        tokenizer = load_tokenizer(section.path)
    except ValueError as exc:
        raise ConfigError(f"reward.model.path: {str(exc).removeprefix('model.path=')}") from None
    model_config = ModelConfig(path=section.path, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
                               score_head=True, value_head_path=section.value_head_path)
    budget = section.max_tokens_per_batch or cfg.engine.max_tokens_per_micro_batch
    offload = "params" if section.offload else ("params" if cfg.engine.offload == "params" else "none")
    engine_config = replace(cfg.engine, ulysses_sp_size=1, max_tokens_per_micro_batch=budget, offload=offload,
                            balance_dp_tokens=False, gradient_checkpointing=False)
    engine = FSDPEngine(model_config, engine_config, backend=backend, patch_toggles=cfg.patches)
    try:
        engine.initialize()
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"reward.model.path ({section.path}): {' '.join(str(exc).split())}") from None
    return RewardModelSource(section, engine, tokenizer, policy_tokenizer, cfg.engine.pad_mode)
