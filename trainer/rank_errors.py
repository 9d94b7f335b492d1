"""An error raised on one rank reaches every rank, so all of them stop with the same line.

Without it a rank whose reward function raised on its own record would exit while its peers
waited in the next collective until the process-group timeout. :func:`on_every_rank` runs a
piece of per-rank work that is followed by a collective (scoring completions, a check only
rank 0 makes), then lets every rank learn whether any failed (one ``all_gather_object``).
"""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from polyfsdp.backends.distributed import all_gather_object, current_rank, current_world_size

from .errors import ConfigError, DataError, RankError
from .startup import rank_prefix

T = TypeVar("T")


def error_prefix(rank: int | None = None, prog: str = "polyfsdp-train") -> str:
    """How ``prog`` starts an error line on ``rank`` (default: this process's)."""
    return rank_prefix(current_rank() if rank is None else rank, prog)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


_thread = threading.local()


@contextmanager
def rank_local() -> Iterator[None]:
    """On this thread, :func:`on_every_rank` runs its work alone (no collective): for work on a
    background thread (trainer/algos/sample_ahead.py's generation), whose outcome the main
    thread then passes through :func:`on_every_rank` itself."""
    _thread.local = True
    try:
        yield
    finally:
        _thread.local = False


def on_every_rank(work: Callable[[], T]) -> T:
    """``work()``'s result; if it raised on any rank, a :class:`RankError` on every rank (a
    user error's message as it is, another error's type and message; the failing rank
    re-raises a non-user error itself, so its traceback is kept). Every rank must call it
    (inside :func:`rank_local`: only ``work()``)."""
    if current_world_size() == 1 or getattr(_thread, "local", False):
        return work()
    error, result = None, None
    try:
        result = work()
    except Exception as exc:  # noqa: BLE001 - every kind must reach the peers, or they hang
        error = exc
    user = isinstance(error, (ConfigError, DataError))
    report = None if error is None else (_one_line(error) if user else f"{type(error).__name__}: {_one_line(error)}",
                                         user)
    failures = [(rank, r) for rank, r in enumerate(all_gather_object(report)) if r is not None]
    if not failures:
        return result
    rank, (message, was_user_error) = failures[0]
    if rank == current_rank() and not was_user_error:
        raise error
    raise RankError(rank, message)


def _fingerprint(source) -> tuple[int, int, str]:
    digest = hashlib.sha256()
    train, held_out = getattr(source, "train_examples", []), source.eval_examples
    for example in (*train, *held_out):
        digest.update(repr((example.prompt, example.answer)).encode())
    return len(train), len(held_out), digest.hexdigest()


def check_same_data(source, data) -> None:
    """One ConfigError on every rank unless every rank read the same records (the files of
    ``data`` differ between hosts, say): each rank would otherwise index a different list."""
    if current_world_size() == 1:
        return
    prints = all_gather_object(_fingerprint(source))
    for rank, other in enumerate(prints):
        if other != prints[0]:
            files = data.path or data.train_files or f"data.task={data.task}"
            raise ConfigError(f"data: rank {rank} read different records than rank 0 ({other[0]} training and "
                              f"{other[1]} evaluation records vs {prints[0][0]} and {prints[0][1]}, or the same "
                              f"counts with other contents) from {files}; every rank must read identical files")
