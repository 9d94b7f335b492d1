"""HTTP requests with one overall deadline and a cap on the answer's size (standard library only).

urllib's ``timeout`` bounds each socket operation, not the request: a server that sends one byte
every few seconds keeps a request alive as long as it likes (a judge with ``timeout_s=5`` hung for
596 s), and ``read()`` takes whatever size the server sends (a 300 MB answer took the process to
21.7 GB). :func:`fetch` gives the connection, the request, the status line, the headers and the
body one monotonic deadline: before each socket read, the socket's timeout is set to the time
left, and a read that would start after the deadline raises :class:`TimeoutError` instead. The body
is read in chunks and refused (:class:`AnswerTooLarge`) as soon as it passes ``max_bytes``, or at
once when its Content-Length says it will; an error answer's body is read up to
``ERROR_BODY_BYTES``. urllib's handlers stay in place (https, proxies from the environment).
"""
from __future__ import annotations

import functools
import http.client
import io
import time
import urllib.error
import urllib.request

# An error answer (4xx, 5xx) is only quoted in a one-line message: its first 64 KiB are plenty.
ERROR_BODY_BYTES = 64 << 10
_CHUNK = 64 << 10


class AnswerTooLarge(Exception):
    """The answer's body is over ``limit`` bytes (nothing past ``limit`` + one chunk was read)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer is over {limit} bytes")
        self.limit = limit


class HttpStatus(Exception):
    """A non-2xx answer: its status ``code`` and the first ``ERROR_BODY_BYTES`` of its ``body``."""

    def __init__(self, code: int, body: bytes) -> None:
        super().__init__(f"HTTP {code}")
        self.code, self.body = code, body


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class _DeadlineReads(io.RawIOBase):
    """The response's socket reads (``raw``: the socket's own file), each given the time left."""

    def __init__(self, raw, sock, deadline: float) -> None:
        self.raw, self.sock, self.deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        self.sock.settimeout(_time_left(self.deadline))
        return self.raw.readinto(buffer)

    def close(self) -> None:
        if not self.closed:
            self.raw.close()  # gives the socket back (urllib closed its own reference already)
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(self, sock, *args, deadline: float, **kwargs) -> None:
        super().__init__(sock, *args, **kwargs)
        # Nothing is read before begin(): the buffered file is swapped before the status line.
        self.fp = io.BufferedReader(_DeadlineReads(self.fp.detach(), sock, deadline))


class _DeadlineConnection:
    """Connecting and sending within the deadline; responses read within it (a mixin)."""

    def __init__(self, *args, deadline: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self.response_class = functools.partial(_DeadlineResponse, deadline=deadline)

    def connect(self) -> None:
        self.timeout = _time_left(self.deadline)  # connect and the TLS handshake
        super().connect()

    def send(self, data) -> None:
        if self.sock is not None:
            self.sock.settimeout(_time_left(self.deadline))
        super().send(data)


class _HTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_HTTPConnection, req, deadline=self.deadline)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, context=self._context, deadline=self.deadline)


def _read(answer, limit: int | None, truncate: bool = False) -> bytes:
    """The body, in chunks: at most ``limit`` bytes (``truncate``), or :class:`AnswerTooLarge` past it."""
    chunks, size = [], 0
    while True:
        want = _CHUNK if limit is None else min(_CHUNK, limit - size + (0 if truncate else 1))
        chunk = answer.read(want) if want > 0 else b""
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if limit is not None and size > limit:
            raise AnswerTooLarge(limit)


def fetch(request: urllib.request.Request, timeout_s: float, max_bytes: int | None = None) -> bytes:
    """The body of the answer to ``request``, all of it within ``timeout_s`` seconds.

    Raises :class:`TimeoutError` past the deadline (while connecting: urllib's URLError, whose
    reason is the timeout), :class:`HttpStatus` for a non-2xx answer, :class:`AnswerTooLarge` for
    a body over ``max_bytes`` (None: no cap), URLError / ConnectionError when the server is not
    reachable or the connection breaks off mid-answer."""
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline))
    try:
        try:
            answer = opener.open(request, timeout=timeout_s)
        except urllib.error.HTTPError as exc:
            try:
                body = _read(exc, ERROR_BODY_BYTES, truncate=True) if exc.fp is not None else b""
            except (OSError, http.client.HTTPException):
                body = b""  # the status says enough
            finally:
                exc.close()
            raise HttpStatus(exc.code, body) from None
        with answer:
            length = answer.headers.get("Content-Length", "")
            if max_bytes is not None and length.strip().isdigit() and int(length) > max_bytes:
                raise AnswerTooLarge(max_bytes)
            return _read(answer, max_bytes)
    except http.client.HTTPException as exc:  # IncompleteRead, a malformed status line, ...
        raise ConnectionError(f"the answer broke off ({type(exc).__name__})") from None
