"""Ctrl-C as a terminal delivers it, whatever started the test run.

A non-interactive shell starts a background job (``cmd &``) with SIGINT ignored, its children
inherit that, and Python then keeps SIGINT ignored instead of raising KeyboardInterrupt: a
Ctrl-C test run that way sees no Ctrl-C at all (the run goes on until the test's timeout).
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator


def as_at_a_terminal() -> None:
    """``preexec_fn`` of a child process: SIGINT's default action, so Python raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """In this process (main thread), SIGINT raises KeyboardInterrupt for the block, as Python's
    own handler does at a terminal; the previous disposition after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
