"""An OpenAI-compatible judge that misbehaves on POST, on 127.0.0.1, bounded in what it sends.

``GET .../models`` answers a one-model listing at once (unless ``on_get``: a GET misbehaves as a
POST does, e.g. a rollout server's ``/health``); a POST, after its body is read, is answered one of
these ways (``mode``):

- ``drip-headers``: the status line and headers one byte every ``interval_s`` (``count`` bytes at most);
- ``drip-body``: status and headers at once (no Content-Length), then the body one byte every
  ``interval_s`` (``count`` bytes at most);
- ``flood``: status and headers at once (no Content-Length), then ``flood_bytes`` of a JSON-looking
  body as fast as the client reads it;
- ``flood-length``: the same with a Content-Length of ``flood_bytes``.

``sent`` counts the misbehaving answers' bytes the server managed to send (a client that stops
reading and closes makes the next send fail); ``post_seen`` is set when a request it misbehaves on
has been read.
Every connection's thread is a daemon and ends when its bytes are out or the client has gone.
"""
from __future__ import annotations

import json
import socketserver
import threading
import time

MODES = ("drip-headers", "drip-body", "flood", "flood-length")
MODEL = "misbehaving-judge"
_FLOOD_CHUNK = 64 << 10


class MisbehavingJudge:
    def __init__(self, mode: str, interval_s: float = 0.5, count: int = 100, flood_bytes: int = 50 << 20,
                 on_get: bool = False) -> None:
        assert mode in MODES, mode
        self.mode, self.interval_s, self.count, self.flood_bytes = mode, interval_s, count, flood_bytes
        self.on_get = on_get
        self.sent = 0
        self.post_seen = threading.Event()
        self._lock = threading.Lock()
        judge = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                request = self.rfile.readline().decode("latin-1").split()
                headers = {}
                while True:
                    line = self.rfile.readline().decode("latin-1").strip()
                    if not line:
                        break
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = self.rfile.read(int(headers.get("content-length", "0") or 0))
                try:
                    if request and request[0] == "GET" and not judge.on_get:
                        listing = json.dumps({"data": [{"id": MODEL}]}).encode()
                        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                         b"Content-Length: %d\r\n\r\n" % len(listing) + listing)
                        return
                    judge.post_seen.set()
                    judge._answer(self.wfile, body)
                except OSError:
                    pass  # the client gave up: what the tests are about

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="misbehaving-judge").start()

    def _count(self, n: int) -> None:
        with self._lock:
            self.sent += n

    def _send(self, out, data: bytes) -> None:
        out.write(data)
        out.flush()
        self._count(len(data))

    def _answer(self, out, body: bytes) -> None:
        start = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "'
        if self.mode == "drip-headers":
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n" + b"X-Pad: " + \
                   b"a" * self.count
            for i in range(min(self.count, len(head))):
                self._send(out, head[i:i + 1])
                time.sleep(self.interval_s)
            return
        length = b"Content-Length: %d\r\n" % self.flood_bytes if self.mode == "flood-length" else b""
        self._send(out, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n" + length + b"\r\n")
        if self.mode == "drip-body":
            for _ in range(self.count):
                self._send(out, b" ")  # whitespace before the JSON: still a valid answer, were it finished
                time.sleep(self.interval_s)
            return
        self._send(out, start)
        left = self.flood_bytes - len(start)
        while left > 0:
            chunk = min(_FLOOD_CHUNK, left)
            self._send(out, b"a" * chunk)
            left -= chunk

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
