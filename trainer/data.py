"""Prompts and answers: the built-in task's generator or a local JSONL/parquet file.

Both are deterministic functions of ``(seed, phase, step)``: a resumed run draws exactly
the batches the uninterrupted run would have drawn, with no iterator state to save.
Held-out evaluation examples are never used for training.
"""
from __future__ import annotations

import json
import logging
import os
import random

from .task import Example, ReverseTask

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A data file that cannot be used (missing, unreadable, missing fields); one-line message."""


class BuiltinSource:
    """The built-in task's generator; evaluation prompts are excluded from training."""

    def __init__(self, task: ReverseTask, seed: int, eval_size: int) -> None:
        self.task, self.seed = task, seed
        if eval_size >= task.distinct_prompts:
            # Training draws only prompts outside the held-out set: none would be left.
            raise DataError(f"data.eval_size={eval_size} holds out all {task.distinct_prompts} distinct prompts of "
                            f"the task, leaving none for training; lower data.eval_size or widen data.alphabet / "
                            f"data.max_len")
        rng = random.Random(f"polyfsdp-eval-{seed}")
        seen: dict[str, Example] = {}
        # Bounded: a tiny task space may hold fewer distinct prompts than eval_size.
        for _ in range(eval_size * 20):
            if len(seen) >= eval_size:
                break
            ex = task.sample(rng)
            seen.setdefault(ex.prompt, ex)
        self.eval_examples = list(seen.values())
        self._eval_prompts = set(seen)

    def batch(self, phase: str, step: int, count: int) -> list[Example]:
        """The ``count`` training examples of ``step`` in ``phase`` (same on every rank)."""
        rng = random.Random(f"polyfsdp-{phase}-{self.seed}-{step}")
        out = []
        while len(out) < count:
            ex = self.task.sample(rng)
            if ex.prompt not in self._eval_prompts:
                out.append(ex)
        return out


class FileSource:
    """Records from a local file; the last ``eval_size`` are held out, the rest are
    visited in a seeded random order, epoch after epoch."""

    def __init__(self, records: list[Example], seed: int, eval_size: int, path: str) -> None:
        if len(records) <= eval_size:
            raise DataError(f"data.path {path}: {len(records)} records, but data.eval_size={eval_size} are held out "
                            f"and at least one is needed for training")
        self.train_examples = records[: len(records) - eval_size]
        self.eval_examples = records[len(records) - eval_size:]
        self.seed, self.path = seed, path
        self._orders: dict[tuple[str, int], list[int]] = {}

    def _order(self, phase: str, epoch: int) -> list[int]:
        key = (phase, epoch)
        if key not in self._orders:
            order = list(range(len(self.train_examples)))
            random.Random(f"polyfsdp-{phase}-{self.seed}-epoch{epoch}").shuffle(order)
            self._orders = {key: order}
        return self._orders[key]

    def batch(self, phase: str, step: int, count: int) -> list[Example]:
        """The ``count`` training examples of ``step`` in ``phase``."""
        n = len(self.train_examples)
        out = []
        for position in range(step * count, (step + 1) * count):
            epoch, index = divmod(position, n)
            out.append(self.train_examples[self._order(phase, epoch)[index]])
        return out


def _record(raw, where: str, prompt_key: str, answer_key: str) -> Example:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object with fields {prompt_key!r} and {answer_key!r}, "
                        f"got {type(raw).__name__}")
    missing = [k for k in (prompt_key, answer_key) if k not in raw]
    if missing:
        raise DataError(f"{where}: missing field {missing[0]!r} (record has {sorted(raw)}); set "
                        f"data.prompt_key / data.answer_key to the names your file uses")
    values = []
    for key in (prompt_key, answer_key):
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f"{where}: field {key!r} must be text, got {type(value).__name__} {value!r}")
        values.append(str(value))
    return Example(prompt=values[0], answer=values[1])


def read_jsonl(path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """Examples from a JSON-lines file (blank lines skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
                out.append(_record(raw, f"{path} line {number}", prompt_key, answer_key))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason}); JSON lines files must be UTF-8") from None
    return out


def read_parquet(path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """Examples from a parquet file (needs pyarrow, or pandas with a parquet engine)."""
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except ImportError:
        try:
            import pandas as pd
        except ImportError:
            raise DataError(f"data=parquet ({path}) needs pyarrow or pandas: pip install pyarrow "
                            f"(or use a JSONL file with data=jsonl)") from None
        try:
            rows = pd.read_parquet(path).to_dict("records")
        except ImportError as exc:
            raise DataError(f"data=parquet ({path}): pandas has no parquet engine: {exc}; pip install pyarrow") from None
    return [_record(r, f"{path} row {i}", prompt_key, answer_key) for i, r in enumerate(rows)]


def build_source(data, seed: int):
    """The training/evaluation source a DataSection describes."""
    if data.source == "builtin":
        task = ReverseTask(alphabet=data.alphabet, min_len=data.min_len, max_len=data.max_len)
        return BuiltinSource(task, seed, data.eval_size)
    if not os.path.isfile(data.path):
        raise DataError(f"data.path: {data.path!r} is not a file")
    reader = read_jsonl if data.source == "jsonl" else read_parquet
    records = reader(data.path, data.prompt_key, data.answer_key)
    return FileSource(records, seed, data.eval_size, data.path)


def check_tokenizer_covers(source, tokenizer) -> None:
    """A file's text must use only characters the character tokenizer knows: others become
    ``<unk>``, which decoding drops, so an answer holding one could never earn full reward.
    Without a ``<bos>`` token every prompt must encode to at least one token."""
    from .task import CharTokenizer

    if not isinstance(source, FileSource):
        return
    if getattr(tokenizer, "bos_token_id", None) is None:
        for ex in source.train_examples + source.eval_examples:
            if not tokenizer.encode(ex.prompt):
                raise DataError(f"data.path {source.path}: prompt {ex.prompt!r} has no tokens and the tokenizer has "
                                f"no bos token to start it; every prompt needs at least one token")
    if not isinstance(tokenizer, CharTokenizer):
        return
    known = set(tokenizer.chars)
    unknown: dict[str, str] = {}
    for ex in source.train_examples + source.eval_examples:
        for ch in (ex.prompt + ex.answer):
            if ch not in known:
                unknown.setdefault(ch, ex.prompt)
    if unknown:
        chars = ", ".join(repr(ch) for ch in sorted(unknown))
        first = next(iter(unknown.values()))
        raise DataError(f"data.path {source.path}: {chars} (first in prompt {first!r}) not in the character "
                        f"tokenizer; use model.path=DIR with a tokenizer that covers them")


def max_answer_tokens(source, tokenizer) -> int:
    """Longest answer of the training and evaluation sets, in tokens (for generation length)."""
    if isinstance(source, BuiltinSource):
        return source.task.max_answer_chars
    examples = source.train_examples + source.eval_examples
    return max(len(tokenizer.encode(ex.answer)) for ex in examples)


def check_generation_budget(source, tokenizer, max_new_tokens: int) -> None:
    """Warn when sampled completions cannot hold the longest answer plus ``<eos>``: such
    answers are cut off, and their reward can never reach 1."""
    need = max_answer_tokens(source, tokenizer) + 1
    if need > max_new_tokens:
        logger.warning("algo.grpo.max_new_tokens=%d cannot hold the longest answer (%d tokens with <eos>): "
                       "its completions are cut off and never earn full reward; set algo.grpo.max_new_tokens=%d",
                       max_new_tokens, need, need)
