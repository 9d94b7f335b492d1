"""One SFT step: negative log-likelihood of ``answer + <eos>`` given ``<bos> + prompt``, or,
with a multi-turn rollout engine, of a demonstration conversation's assistant turns
(trainer/algos/tool_sft.py)."""
from __future__ import annotations

import time

from polyfsdp.engines.losses import SFTLoss

from ..data.batch import build_batch
from ..data.chat import example_prompt_tokens
from ..data.example import Example


def sft_pairs(tokenizer, examples: list[Example]) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, answer tokens + eos) per example."""
    return [(example_prompt_tokens(tokenizer, ex), tokenizer.encode(ex.answer) + [tokenizer.eos_token_id])
            for ex in examples]


def sft_step(engine, tokenizer, examples: list[Example], loss_fn: SFTLoss, conversations=None) -> dict:
    """Train one step on this rank's ``examples``; returns the engine's metrics plus
    ``tokens`` (this rank's sequence tokens) and ``step_time_s``. ``conversations``: the
    multi-turn rollout engine (``rollout.env``), whose conversations the demonstrations follow."""
    from .tool_sft import conversation_sequences

    t0 = time.perf_counter()
    pairs = sft_pairs(tokenizer, examples) if conversations is None else \
        conversation_sequences(conversations, tokenizer, examples)
    images = examples if conversations is None else None  # a prompt's images (trainer/data/batch.py)
    batch = build_batch(pairs, engine.engine_config.pad_mode, tokenizer.pad_token_id, images=images)
    metrics = engine.train_batch(batch, loss_fn)
    metrics["tokens"] = sum(len(pair[0]) + len(pair[1]) for pair in pairs)
    metrics["step_time_s"] = time.perf_counter() - t0
    return metrics
