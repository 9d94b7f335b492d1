"""``reward.fn``: find the reward function (a built-in, ``path/to/file.py:fn`` or
``package.module:fn``) and score completions with it, verl's way.

The function is called as ``fn(data_source, solution_str, ground_truth, extra_info, **kwargs)``
and returns a number or a dict holding ``"score"`` (its other numeric keys become metrics).
Anything else (an exception, ``sys.exit``, NaN/inf, a number beyond ``MAX_ABS_REWARD``, a
non-number, a call longer than ``reward.timeout_s``) stops the run with one line: a silent
zero would train on a broken signal. Each call gets its own deep copy of the record's
``extra_info``, so what a function changes there never reaches the next call.
"""
from __future__ import annotations

import copy
import inspect
import math
import numbers
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable

from polyfsdp.backends.distributed import all_gather_object

from ..errors import ConfigError, RewardError
from ..config.plugins import first_line, load_object
from ..rank_errors import error_prefix
from .rules import BUILTIN_ANSWERS, BUILTIN_REWARDS
from .timeout import CallDeadline, RewardTimeout

# The rule each built-in task is scored with when reward.fn=auto.
TASK_DEFAULT_REWARD = {"reverse": "char_match", "arith_words": "gsm8k", "calculator": "gsm8k",
                       "count_squares": "exact_match"}
FILE_DEFAULT_REWARD = "char_match"
# Rewards (and their numeric extras) beyond this magnitude are refused: group means and
# variances of larger values overflow float32 (1e308 is finite, its square is not).
MAX_ABS_REWARD = 1e9


def call_user_code(call, who: str, where: str, deadline: CallDeadline | None, timeout_key: str):
    """``call()`` of the user's code (a reward function, an environment) under ``deadline``
    (None: no limit): an exception, ``sys.exit`` or an overrun is a one-line RewardError naming
    ``who`` and ``where`` (the record); a call stuck in C past the grace period ends the process
    with that line."""
    try:
        if deadline is None:
            return call()
        hard_stop = (f"{error_prefix()}{who} did not return within {timeout_key}={deadline.timeout_s:g} s (nor "
                     f"{deadline.grace_s:g} s later) {where}; stopping this process")
        with deadline.limit(hard_stop):
            return call()
    except RewardTimeout:
        raise RewardError(f"{who} took longer than {timeout_key}={deadline.timeout_s:g} s {where}; make it faster "
                          f"or raise {timeout_key}") from None
    except SystemExit as exc:
        # User code that exits would end the run with its status (0: "success").
        raise RewardError(f"{who} called sys.exit({exc.code!r}) {where}; it must return, not end the "
                          f"process") from None
    except Exception as exc:
        if os.environ.get(TRACEBACK_SWITCH) == "1":
            traceback.print_exc()  # the whole story, on request; the one line follows
        raise RewardError(f"{who} raised {type(exc).__name__}: {first_line(exc)}{user_frame(exc)} "
                          f"{where}") from None


# POLYFSDP_TRACEBACK=1 prints the full traceback of a failing reward function or environment.
TRACEBACK_SWITCH = "POLYFSDP_TRACEBACK"
# polyfsdp's own package folders (siblings of trainer/, this module's grandparent, wherever they are installed).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN_DIRS = tuple(os.path.join(_ROOT, name) + os.sep for name in ("trainer", "engines", "backends", "patches"))


def user_frame(exc: BaseException) -> str:
    """`` at file:line`` of the innermost frame of ``exc``'s traceback in the user's own code
    (not polyfsdp's, not the standard library's or a package's), else ''."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not (path.startswith(_OWN_DIRS) or "site-packages" in path or "/lib/python" in path
                or frame.filename.startswith("<")):
            return f" at {frame.filename}:{frame.lineno}"
    return ""


def default_reward_name(data) -> str:
    """The built-in rule ``reward.fn=auto`` means for a DataSection."""
    return TASK_DEFAULT_REWARD.get(data.task, FILE_DEFAULT_REWARD) if data.source == "builtin" else FILE_DEFAULT_REWARD


def load_reward_fn(spec: str) -> Callable:
    """The callable ``spec`` names: a built-in name, ``FILE.py:fn`` or ``module:fn``."""
    return load_object(spec, "reward.fn", BUILTIN_REWARDS)


def _as_reward(value) -> float | None:
    """``value`` as a float when it is a real number within +-MAX_ABS_REWARD, else None
    (an int like 10**400 does not even convert)."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_ABS_REWARD else None


@dataclass
class Scorer:
    """A reward function with its ``reward.kwargs``; ``name`` is how errors cite it;
    ``timeout_s`` bounds each call (None: no limit)."""

    fn: Callable
    name: str
    kwargs: dict = field(default_factory=dict)
    timeout_s: float | None = None
    _deadline: CallDeadline | None = field(default=None, init=False, repr=False, compare=False)

    def _call(self, example, solution_str: str, response_ids: list[int], record: str):
        extra_info = copy.deepcopy(example.extra_info or {})
        extra_info["response_ids"] = list(response_ids)
        if self.timeout_s is not None and self._deadline is None:
            self._deadline = CallDeadline(self.timeout_s)
        return call_user_code(
            lambda: self.fn(example.data_source, solution_str, example.answer, extra_info, **self.kwargs),
            f"reward.fn={self.name}", f"(record {record}, completion {solution_str[:80]!r})", self._deadline,
            "reward.timeout_s")

    def score(self, example, solution_str: str, response_ids: list[int]) -> tuple[float, dict[str, float]]:
        """The reward of one completion and its extra numeric metrics."""
        value, extras, _ = self.score_with_answer(example, solution_str, response_ids)
        return value, extras

    def score_with_answer(self, example, solution_str: str, response_ids: list[int]):
        """``(reward, extra metrics, answer)``: the answer is the dict result's ``"pred"``
        (verl's key), else what a built-in rule compares, else None (not comparable)."""
        record = example.where or f"with prompt {example.prompt!r}"
        result = self._call(example, solution_str, response_ids, record)
        extras: dict[str, float] = {}
        value = result
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(f"reward.fn={self.name} returned a dict without 'score' (keys "
                                  f"{sorted(result)}) for record {record}")
            value = result["score"]
            extras = {k: v for k, v in ((k, _as_reward(v)) for k, v in result.items() if k != "score")
                      if v is not None}
        number = _as_reward(value)
        if number is None:
            shown = f"{value!r}"[:40] + ("..." if len(f"{value!r}") > 40 else "")
            raise RewardError(f"reward.fn={self.name} returned {shown} for record {record}; expected a finite "
                              f"number within +-{MAX_ABS_REWARD:g} (or a dict with such a 'score')")
        pred = result.get("pred") if isinstance(result, dict) else None
        if pred is None and self.name in BUILTIN_ANSWERS:
            pred = BUILTIN_ANSWERS[self.name](solution_str)
        return number, extras, None if pred is None else str(pred)

    def score_all(self, examples, texts: list[str], responses: list[list[int]], group: int = 1,
                  answers: list | None = None):
        """Rewards of ``texts`` (row i answers ``examples[i // group]``) and, per extra metric,
        the list of values that were reported; each row's answer is appended to ``answers``
        when given."""
        rewards, extras = [], {}
        for i, (text, ids) in enumerate(zip(texts, responses)):
            value, more, answer = self.score_with_answer(examples[i // group], text, ids)
            rewards.append(value)
            if answers is not None:
                answers.append(answer)
            for key, v in more.items():
                extras.setdefault(key, []).append(v)
        return rewards, extras


def check_signature(fn: Callable, spec: str, kwargs: dict) -> None:
    """Refuse a function that cannot take verl's four arguments plus ``reward.kwargs`` now,
    before any model is built, rather than at the first evaluation."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read (some C functions): a mismatch shows at the first call
    try:
        signature.bind("data_source", "solution_str", "ground_truth", {}, **kwargs)
    except TypeError as exc:
        extra = "".join(f", {key}=..." for key in kwargs)
        raise ConfigError(f"reward.fn={spec}: {getattr(fn, '__name__', 'the function')}{signature} cannot be called "
                          f"as fn(data_source, solution_str, ground_truth, extra_info{extra}) ({exc}); give it "
                          f"verl's signature (data_source, solution_str, ground_truth, extra_info=None"
                          f"{', **kwargs' if kwargs else ''})") from None


def build_scorer(reward_section, data) -> Scorer:
    """The Scorer a RewardSection asks for (``auto``: the data's default rule)."""
    spec = reward_section.fn if reward_section.fn != "auto" else default_reward_name(data)
    fn, kwargs = load_reward_fn(spec), dict(reward_section.kwargs or {})
    check_signature(fn, spec, kwargs)
    return Scorer(fn, spec, kwargs, timeout_s=reward_section.timeout_s)


def mean_over_ranks(extras: dict[str, list[float]]) -> dict[str, float]:
    """Per extra metric, the mean over every rank's reported values (``reward/<key>``).
    Ranks may report different keys, so the key sets are gathered first."""
    sums: dict[str, tuple[float, int]] = {}
    for part in all_gather_object({k: (sum(v), len(v)) for k, v in extras.items()}):
        for key, (total, count) in part.items():
            before = sums.get(key, (0.0, 0))
            sums[key] = (before[0] + total, before[1] + count)
    return {f"reward/{k}": total / count for k, (total, count) in sorted(sums.items()) if count}
