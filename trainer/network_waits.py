"""Waiting on a network peer (the judge's server) without outliving a stop.

Requests to a peer run on worker threads while the main thread waits for them. Two things kept a
stopped run alive until ``kill -9`` (the stop line printed, the process still there):
ThreadPoolExecutor's workers are joined when the interpreter exits, so one blocked in a read held
the exit; and SIGTERM's handler only sets the job's flag (trainer/run/stop.py), which the job reads
at step boundaries, never while the main thread waited for a peer. So:

- :class:`DaemonPool` runs the requests on daemon threads, which nothing joins: a process that
  ends never waits for one;
- :func:`wait_or_stop` waits for the requests and, every ``POLL_S`` on the main thread, reads the
  flag of the job's StopRequest (:func:`watch_stop`): a SIGTERM raises :class:`StoppedWhileWaiting`
  there, which ``polyfsdp-train`` reports in one line with exit status 143. Ctrl-C needs nothing
  more: it interrupts the wait itself (KeyboardInterrupt, exit status 130).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Callable

# How often the main thread, waiting on a peer, looks at the stop flag (a SIGTERM waits at most this).
POLL_S = 0.2


class StoppedWhileWaiting(BaseException):
    """A SIGTERM came while the main thread waited on ``what`` (a network peer). A BaseException,
    as KeyboardInterrupt is: no ``except Exception`` on the way (on_every_rank's) makes it an error."""

    def __init__(self, what: str) -> None:
        super().__init__(f"stopped by SIGTERM while waiting for {what}")
        self.what = what


# The StopRequests in force (objects with a ``requested`` flag); the job's is the innermost.
_stops: list = []


def watch_stop(stop) -> None:
    """Let waits on peers read ``stop.requested`` (until :func:`unwatch_stop`)."""
    _stops.append(stop)


def unwatch_stop(stop) -> None:
    if stop in _stops:
        _stops.remove(stop)


def stop_requested() -> bool:
    return any(stop.requested for stop in _stops)


def wait_or_stop(futures: list[Future], what: str) -> list:
    """The futures' results, in order; the first failure raises at once. On the main thread, a
    SIGTERM raises :class:`StoppedWhileWaiting` (``what``: the peer, e.g. ``reward.judge (URL)``)
    within ``POLL_S``, the requests left to their daemon threads."""
    on_main = threading.current_thread() is threading.main_thread()
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=POLL_S if on_main else None, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()  # raises the failure, if this one failed
        if pending and on_main and stop_requested():
            for future in pending:
                future.cancel()
            raise StoppedWhileWaiting(what)
    return [future.result() for future in futures]


class DaemonPool:
    """Runs submitted calls, at most ``workers`` at once, on daemon threads named ``name-N``."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self.name = workers, name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the pool is closed")
            self._calls.put((future, fn, args))
            if len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            future, fn, args = call
            del call
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001 - the waiter raises it
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args

    def close(self) -> None:
        """Cancel what has not started; running calls finish on their own (never waited for)."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
            for _ in self._threads:
                self._calls.put(None)
