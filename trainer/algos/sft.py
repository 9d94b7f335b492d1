"""One SFT step: negative log-likelihood of the answer given the prompt (``answer + <eos>`` after
``<bos> + prompt``; after a chat-template prompt, the answer as the template writes an assistant
turn, through its end-of-turn token: trainer/data/answer_tokens.py), or, with a multi-turn
rollout engine, of a demonstration conversation's assistant turns (trainer/algos/tool_sft.py)."""
from __future__ import annotations

import time

from polyfsdp.engines.losses import SFTLoss

from ..data.answer_tokens import answer_tokens
from ..data.batch import build_batch
from ..data.chat import example_prompt_tokens
from ..data.example import Example


def sft_pairs(tokenizer, examples: list[Example], chat_template: bool = False) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, answer tokens through the token that ends them) per example;
    ``chat_template``: ``data.apply_chat_template``."""
    return [(example_prompt_tokens(tokenizer, ex), answer_tokens(tokenizer, ex, chat_template)) for ex in examples]


def sft_step(engine, tokenizer, examples: list[Example], loss_fn: SFTLoss, conversations=None,
             chat_template: bool = False) -> dict:
    """Train one step on this rank's ``examples``; returns the engine's metrics plus
    ``tokens`` (this rank's sequence tokens) and ``step_time_s``. ``conversations``: the
    multi-turn rollout engine (``rollout.env``), whose conversations the demonstrations follow;
    ``chat_template``: ``data.apply_chat_template`` (string prompts were rendered by the template)."""
    from .tool_sft import conversation_sequences

    t0 = time.perf_counter()
    pairs = sft_pairs(tokenizer, examples, chat_template) if conversations is None else \
        conversation_sequences(conversations, tokenizer, examples)
    images = examples if conversations is None else None  # a prompt's images (trainer/data/batch.py)
    batch = build_batch(pairs, engine.engine_config.pad_mode, tokenizer.pad_token_id, images=images)
    metrics = engine.train_batch(batch, loss_fn)
    metrics["tokens"] = sum(len(pair[0]) + len(pair[1]) for pair in pairs)
    metrics["step_time_s"] = time.perf_counter() - t0
    return metrics
