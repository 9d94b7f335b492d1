"""``reward.timeout_s``: a reward call that runs too long is stopped with an exception in
the thread that called it.

How, and why this way: the reward runs on the calling (main) thread, unchanged, and one
watchdog thread per process waits for the call's deadline. When it passes, the watchdog
raises :class:`RewardTimeout` inside the caller with CPython's
``PyThreadState_SetAsyncExc``, which the interpreter delivers at the next bytecode: a
pure-Python infinite loop stops at once. Alternatives considered:

- running the reward in a worker thread: a thread cannot be stopped, and reward libraries
  (math_verify, verl's graders) set their own ``signal.alarm`` timeouts, which only work on
  the main thread;
- ``signal.alarm``/``setitimer`` on the main thread: the same graders re-arm and cancel
  that one process-wide timer, which would silently switch ours off;
- a worker process: rewards would have to be picklable and every call would pay a round trip.

An asynchronous exception is not delivered while the thread is inside one long C call (a
``time.sleep``, a blocking socket read); if the call has not returned ``GRACE_S`` seconds
after its deadline, the watchdog prints ``hard_stop_line`` and ends the process with exit
status 2, so no rank waits forever. ``RewardTimeout`` derives from ``BaseException`` so a
reward's own ``except Exception`` cannot swallow it.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

# Seconds after the deadline before a call stuck in C code ends the process.
GRACE_S = 10.0
EXIT_HARD_STOP = 2


class RewardTimeout(BaseException):
    """Raised in the caller's thread when a reward call overran ``reward.timeout_s``."""


def _raise_in(thread_id: int, exc_type: type[BaseException] | None) -> None:
    # exc_type None clears an exception that was set but not yet delivered.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type is not None else None)


class CallDeadline:
    """Bounds calls made under :meth:`limit` to ``timeout_s`` seconds each (one watchdog thread)."""

    def __init__(self, timeout_s: float, grace_s: float = GRACE_S) -> None:
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self._lock = threading.Condition()
        self._call: dict | None = None  # the running call: thread, deadline, fired, hard-stop line
        self._watchdog: threading.Thread | None = None

    @contextmanager
    def limit(self, hard_stop_line: str) -> Iterator[None]:
        """Run the body under the deadline; raises :class:`RewardTimeout` if it overran.
        ``hard_stop_line`` is printed before the process ends if the body never returns."""
        call = {"thread": threading.get_ident(), "deadline": time.monotonic() + self.timeout_s, "fired": False,
                "line": hard_stop_line}
        with self._lock:
            self._start_watchdog()
            self._call = call
            self._lock.notify()
        try:
            yield
        finally:
            while True:
                try:
                    with self._lock:
                        self._call = None
                        if call["fired"]:
                            _raise_in(call["thread"], None)  # fired as the call returned: drop it undelivered
                    break
                except RewardTimeout:
                    continue  # delivered while leaving; the watchdog fires once per call, so once
        if call["fired"]:
            raise RewardTimeout()

    def _start_watchdog(self) -> None:
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, name="polyfsdp-reward-timeout", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        with self._lock:
            while True:
                call = self._call
                if call is None:
                    self._lock.wait()
                    continue
                now = time.monotonic()
                if not call["fired"]:
                    if now < call["deadline"]:
                        self._lock.wait(call["deadline"] - now)
                        continue
                    call["fired"] = True
                    _raise_in(call["thread"], RewardTimeout)
                    continue
                stop_at = call["deadline"] + self.grace_s
                if now < stop_at:
                    self._lock.wait(stop_at - now)
                    continue
                # Still inside the call: stuck in C code, where the exception cannot reach it.
                print(call["line"], file=sys.stderr, flush=True)
                os._exit(EXIT_HARD_STOP)
