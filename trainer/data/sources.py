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

from .images import ImagePolicy, content_parts, message_text, place_images, read_images
from .demonstrations import MESSAGES_FIELD, DemonstrationError, final_answer, opening, plain_value, read_conversation
from ..errors import DataError
from .tokenizers import CharTokenizer
from .example import Example
from .task import ReverseTask

logger = logging.getLogger(__name__)
# The stream the RL phase's prompts are drawn under (``batch(stream, step, count)``): kept from
# when the phase was called grpo, so a seed draws the same prompts as it did then.
RL_DATA_STREAM = "grpo"


def _identity(ex: Example) -> tuple:
    """What tells two generated examples apart: the prompt, and for a task whose prompts share
    their text (trainer/data/count_squares.py) what ``where`` says was drawn."""
    return ex.prompt, ex.where


class BuiltinSource:
    """The built-in task's generator; evaluation prompts are excluded from training."""

    def __init__(self, task: ReverseTask, seed: int, eval_size: int, encoder=None) -> None:
        self.task, self.seed, self.encoder = task, seed, encoder
        sample = task.sample(random.Random(0))
        if encoder is not None and sample.conversation:
            # Demonstrations may write characters beyond the default vocabulary (the calculator's
            # JSON tool calls; constant across records): learnt before the preset's model is built.
            encoder.learn_characters([sample])
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
            seen.setdefault(_identity(ex), ex)
        self._eval_prompts = set(seen)
        self.eval_examples = list(seen.values())
        if encoder is not None:
            self.eval_examples = encoder.encode_split(self.eval_examples, "evaluation")
            if not self.eval_examples:
                raise DataError(f"data.max_prompt_length={encoder.max_len}: every prompt of the {task.name} task "
                                f"is longer; raise it")

    def batch(self, phase: str, step: int, count: int) -> list[Example]:
        """The ``count`` training examples of ``step`` in ``phase`` (same on every rank)."""
        rng = random.Random(f"polyfsdp-{phase}-{self.seed}-{step}")
        out, attempts = [], 0
        while len(out) < count:
            attempts += 1
            if attempts > 1000 * count:
                raise DataError(f"data.max_prompt_length: almost every {self.task.name} prompt is longer; raise it")
            ex = self.task.sample(rng)
            if _identity(ex) in self._eval_prompts:
                continue
            if self.encoder is not None:
                ex = self.encoder.encode(ex)  # None: over data.max_prompt_length, filtered
            if ex is not None:
                out.append(ex)
        return out


class FileSource:
    """Records from a local file; the last ``eval_size`` are held out, the rest are
    visited in a seeded random order, epoch after epoch."""

    def __init__(self, records: list[Example], seed: int, eval_size: int, path: str,
                 eval_records: list[Example] | None = None, key: str = "data.path") -> None:
        if eval_records is not None:
            # Validation files replace the held-out tail; eval_size caps how many are scored.
            if not eval_records or not records:
                which = "data.val_files" if not eval_records else f"{key} {path}"
                raise DataError(f"{which}: no records left to {'evaluate' if not eval_records else 'train'} on")
            self.train_examples, self.eval_examples = list(records), list(eval_records[:eval_size])
        elif len(records) <= eval_size:
            raise DataError(f"{key} {path}: {len(records)} records, but data.eval_size={eval_size} are held out "
                            f"and at least one is needed for training: lower data.eval_size or give data=files "
                            f"data.val_files=[...]")
        else:
            self.train_examples = records[: len(records) - eval_size]
            self.eval_examples = records[len(records) - eval_size:]
        # ``key`` is the config key the user set (data.path or data.train_files): errors name it.
        self.seed, self.path, self.key = seed, path, key
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


# Where the reference answer may sit when data.answer_key is not set: verl's layout first.
AUTO_ANSWER_KEYS = ("reward_model.ground_truth", "answer")


def _lookup(raw: dict, dotted: str):
    """(found, value) of a dotted key path (``reward_model.ground_truth``); a literal
    top-level key with dots wins."""
    if dotted in raw:
        return True, raw[dotted]
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _messages(value, where: str, key: str) -> tuple:
    """A chat prompt: a non-empty list of ``{"role": str, "content": str}``; a content may also be
    a list of image and text parts (trainer/data/images.py)."""
    if not value:
        raise DataError(f"{where}: field {key!r} is an empty list of chat messages")
    out = []
    for i, message in enumerate(value):
        message = plain_value(message)
        if isinstance(message, dict) and isinstance(message.get("role"), str) \
                and isinstance(plain_value(message.get("content")), (list, tuple)):
            out.append({"role": message["role"], "content": content_parts(message["content"], where, key, i)})
            continue
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where}: field {key!r} message {i} must be {{\"role\": text, \"content\": text}}, "
                            f"got {str(message)[:80]}")
        out.append({"role": message["role"], "content": message["content"]})
    return tuple(out)


def _record(raw, where: str, prompt_key: str, answer_key: str | None, base_dir: str = "",
            image_policy: ImagePolicy = ImagePolicy()) -> Example:
    """An Example from one record in verl's RL layout (or today's ``{"prompt", "answer"}``),
    with the demonstration conversation of its ``messages`` field (trainer/data/demonstrations.py)
    when it has one (and ``messages`` is not its prompt), and its images (trainer/data/images.py;
    a path is relative to ``base_dir``, the data file's directory; ``image_policy`` bounds them)."""
    answer_keys = (answer_key,) if answer_key else AUTO_ANSWER_KEYS
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object with fields {prompt_key!r} and {answer_keys[-1]!r}, "
                        f"got {type(raw).__name__}")
    conversation = None
    if MESSAGES_FIELD in raw and prompt_key != MESSAGES_FIELD:
        try:
            conversation = read_conversation(raw[MESSAGES_FIELD])
        except DemonstrationError as exc:
            raise DataError(f"{where}: {exc}") from None
    found, prompt = _lookup(raw, prompt_key)
    prompt_field = prompt_key
    if not found and conversation is not None:
        found, prompt, prompt_field = True, list(opening(conversation)), MESSAGES_FIELD
    if not found:
        raise DataError(f"{where}: missing field {prompt_key!r} (record has {sorted(raw)}); set "
                        f"data.prompt_key to the name your file uses")
    for key in answer_keys:
        found, answer = _lookup(raw, key)
        if found:
            break
    else:
        if conversation is None:
            names = " or ".join(repr(k) for k in reversed(answer_keys))
            raise DataError(f"{where}: missing field {names} (record has {sorted(raw)}); set "
                            f"data.answer_key to the name your file uses")
        key, answer = MESSAGES_FIELD, final_answer(conversation)
    prompt, answer = plain_value(prompt), plain_value(answer)
    images = read_images(raw, where, base_dir, image_policy)
    messages = None
    if images and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]  # the images go in front of its text
    if isinstance(prompt, list):
        messages = place_images(_messages(prompt, where, prompt_field), len(images), where, prompt_field)
        prompt = "\n".join(message_text(m) for m in messages)
    for name, value in ((prompt_key, prompt), (key, answer)):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            kind = "text or a list of chat messages" if name == prompt_key else "text"
            raise DataError(f"{where}: field {name!r} must be {kind}, got {type(value).__name__} {str(value)[:80]}")
    data_source = plain_value(raw.get("data_source")) or ""
    if not isinstance(data_source, str):
        raise DataError(f"{where}: field 'data_source' must be text, got {type(data_source).__name__}")
    extra_info = plain_value(raw.get("extra_info"))
    if extra_info is not None and not isinstance(extra_info, dict):
        raise DataError(f"{where}: field 'extra_info' must be an object, got {type(extra_info).__name__}")
    return Example(prompt=str(prompt), answer=str(answer), messages=messages, data_source=data_source,
                   extra_info=extra_info, where=where, conversation=conversation, images=images)


def read_jsonl(path: str, prompt_key: str = "prompt", answer_key: str | None = None,
               images: ImagePolicy = ImagePolicy()) -> list[Example]:
    """Examples from a JSON-lines file (blank lines skipped); ``images`` bounds their images."""
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
                out.append(_record(raw, f"{path} line {number}", prompt_key, answer_key, os.path.dirname(path),
                                   images))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason}); JSON lines files must be UTF-8") from None
    return out


def read_parquet(path: str, prompt_key: str = "prompt", answer_key: str | None = None,
                 images: ImagePolicy = ImagePolicy()) -> list[Example]:
    """Examples from a parquet file (needs pyarrow, or pandas with a parquet engine); ``images``
    bounds their images."""
    try:
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
                raise DataError(f"data=parquet ({path}): pandas has no parquet engine: {exc}; "
                                f"pip install pyarrow") from None
    except DataError:
        raise
    except Exception as exc:  # pyarrow's ArrowInvalid and friends: not a parquet file
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: not a readable parquet file ({detail})") from None
    return [_record(r, f"{path} row {i}", prompt_key, answer_key, os.path.dirname(path), images)
            for i, r in enumerate(rows)]


READERS = {".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet, ".pq": read_parquet}


def read_files(paths, key: str, prompt_key: str, answer_key: str | None, reader=None,
               images: ImagePolicy = ImagePolicy()) -> list[Example]:
    """The records of ``paths`` in order; each file's reader follows its extension unless
    ``reader`` is given. ``key`` names the config key in errors; ``images`` bounds the images."""
    out: list[Example] = []
    for path in [paths] if isinstance(paths, str) else list(paths):
        if not isinstance(path, str) or not os.path.isfile(path):
            where = "" if not isinstance(path, str) or os.path.isabs(path) else \
                f" in the working directory {os.getcwd()}"  # relative paths start where the run started
            raise DataError(f"{key}: {path!r} is not a file{where}")
        read = reader or READERS.get(os.path.splitext(path)[1].lower())
        if read is None:
            raise DataError(f"{key}: {path!r}: unknown file type; expected {', '.join(READERS)}")
        out.extend(read(path, prompt_key, answer_key, images))
    return out


def build_source(data, seed: int, encoder=None, rollout=None):
    """The training/evaluation source a DataSection describes; ``encoder`` (a
    chat.PromptEncoder) sets every prompt's tokens and applies the length policy. ``rollout``:
    the RolloutSection, whose verifiers environment data=verifiers reads."""
    if data.source == "builtin":
        if data.task == "arith_words":
            from .arith_words import ArithWordsTask

            task = ArithWordsTask()
        elif data.task == "count_squares":
            from .count_squares import CountSquaresTask

            task = CountSquaresTask()
        elif data.task == "calculator":
            from ..rollout.tool_task import CalculatorTask

            task = CalculatorTask()
        else:
            task = ReverseTask(alphabet=data.alphabet, min_len=data.min_len, max_len=data.max_len)
        return BuiltinSource(task, seed, data.eval_size, encoder)
    if data.source == "verifiers":
        from ..rollout.drivers.verifiers_agent import verifiers_examples

        records = verifiers_examples(rollout)
        if encoder is not None:
            encoder.learn_characters(records)
            records = encoder.encode_split(records, "train")
        return FileSource(records, seed, data.eval_size, rollout.agent, key="rollout.agent")
    if getattr(data, "train_files", None):
        key, paths, reader = "data.train_files", data.train_files, None
    else:
        key, paths, reader = "data.path", data.path, read_jsonl if data.source == "jsonl" else read_parquet
    images = ImagePolicy(max_pixels=data.max_image_pixels, paths_outside=data.allow_image_paths_outside)
    records = read_files(paths, key, data.prompt_key, data.answer_key, reader, images)
    val = None
    if getattr(data, "val_files", None):
        val = read_files(data.val_files, "data.val_files", data.prompt_key, data.answer_key, images=images)
    if encoder is not None:
        encoder.learn_characters(records + (val or []))
        records = encoder.encode_split(records, "train")
        val = encoder.encode_split(val, "validation") if val is not None else None
    label = paths if isinstance(paths, str) else ",".join(paths)
    return FileSource(records, seed, data.eval_size, label, eval_records=val, key=key)


def tokenized_text(ex: Example) -> str:
    """The text of ``ex`` the character tokenizer sees: a chat prompt as it renders the
    messages, not ``ex.prompt`` (the contents joined by newlines), plus the answer and a
    demonstration conversation's contents."""
    messages = [{**m, "content": message_text(m)} for m in ex.messages or ()]  # image parts hold no characters
    text = (CharTokenizer.chat_text(messages) if messages else ex.prompt) + ex.answer
    return text + "".join(message_text(m) for m in ex.conversation or ())


NEW_TOKENIZER_FIX = "use model.path=DIR with a tokenizer that covers them"


def check_tokenizer_covers(source, tokenizer, fix: str = NEW_TOKENIZER_FIX) -> None:
    """A file's text must use only characters the character tokenizer knows: others become
    ``<unk>``, which decoding drops, so an answer holding one could never earn full reward.
    Without a ``<bos>`` token every prompt must encode to at least one token. ``fix`` says
    what the user can do about missing characters."""
    if not isinstance(source, FileSource):
        return
    if getattr(tokenizer, "bos_token_id", None) is None:
        for ex in source.train_examples + source.eval_examples:
            if ex.prompt_ids is None and not tokenizer.encode(ex.prompt):
                raise DataError(f"{source.key} {source.path}: prompt {ex.prompt!r} has no tokens and the tokenizer has "
                                f"no bos token to start it; every prompt needs at least one token")
    if not isinstance(tokenizer, CharTokenizer):
        return
    known = set(tokenizer.chars)
    unknown: dict[str, str] = {}
    for ex in source.train_examples + source.eval_examples:
        for ch in tokenized_text(ex):
            if ch not in known:
                unknown.setdefault(ch, ex.prompt)
    if unknown:
        chars = ", ".join(repr(ch) for ch in sorted(unknown))
        first = next(iter(unknown.values()))
        raise DataError(f"{source.key} {source.path}: {chars} (first in prompt {first!r}) not in the character "
                        f"tokenizer; {fix}")


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
        logger.warning("algo.actor.max_new_tokens=%d cannot hold the longest answer (%d tokens with <eos>): "
                       "its completions are cut off and never earn full reward; set algo.actor.max_new_tokens=%d",
                       max_new_tokens, need, need)
