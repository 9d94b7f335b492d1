"""JSON over HTTP to one rollout server (standard library only: the trainer needs no HTTP package).

Every failure is a :class:`ServerError` of one line naming the server, the route and what the
server said, so a user with several servers knows which one to look at; for a server polyfsdp
started, also its log and the root cause found there (``explain``: server_log.py).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable

from ...errors import ConfigError


class ServerError(ConfigError):
    """A rollout server that did not start, died, timed out or answered something unusable."""


def server_text(body: bytes) -> str:
    """The message of a vLLM error body ({"error": {"message": ...}} or {"detail": ...}), else its start."""
    try:
        data = json.loads(body)
    except ValueError:
        return " ".join(body.decode("utf-8", "replace").split())[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return " ".join(str(error["message"]).split())[:300]
    if isinstance(data, dict) and data.get("detail"):
        return " ".join(str(data["detail"]).split())[:300]
    return " ".join(json.dumps(data).split())[:300]


# A failure's line -> the same line with what else is known of the server (its exit, its log).
Explain = Callable[[str], str]


class ServerHttp:
    """Requests to one server at ``url`` (``http://host:port``); ``name`` says which in errors.
    ``explain``: for a server polyfsdp started, what completes a failure's line (its
    ServerProcess's ``explain_failure``: the exit code, the log and its root cause); None: the line
    as it is (a server someone else started, whose log is not ours to read)."""

    def __init__(self, url: str, name: str, timeout_s: float, explain: Explain | None = None) -> None:
        self.url, self.name, self.timeout_s = url.rstrip("/"), name, timeout_s
        self.explain = explain

    def failure(self, what: str) -> ServerError:
        """The ServerError of a failure of this server (``what``: one line naming it)."""
        return ServerError(self.explain(what) if self.explain is not None else what)

    def request(self, route: str, payload: dict | None = None, method: str = "POST", timeout_s: float | None = None):
        """The decoded JSON answer of ``route`` (None for an empty body); ServerError otherwise."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"{self.url}{route}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        where = f"{self.name} ({self.url}) {method} {route.split('?')[0]}"
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            raise self.failure(f"{where}: HTTP {exc.code}: {server_text(exc.read())}") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise self.failure(f"{where}: not reachable ({reason}); is the server running and the address "
                               f"right?") from None
        except TimeoutError:
            raise self.failure(f"{where}: no answer within {timeout_s or self.timeout_s:g} s "
                               f"(rollout.server.request_timeout_s)") from None
        if not body.strip():
            return None
        try:
            return json.loads(body)
        except ValueError:
            raise self.failure(f"{where}: answered something that is not JSON: {server_text(body)}") from None

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now (no error: a server still starting is not healthy)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                return answer.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False


class Fanout:
    """One route to every server at once: weight-transfer routes block until the server's workers
    are done, and the workers of all servers must be inside the same collective together."""

    def __init__(self, urls: list[str], timeout_s: float, explain: list[Explain | None] | None = None):
        explain = explain or [None] * len(urls)
        self.servers = [ServerHttp(url, f"rollout server {i}", timeout_s, how)
                        for i, (url, how) in enumerate(zip(urls, explain))]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.servers)), thread_name_prefix="server-post")

    def submit(self, route: str, payload: dict | None = None, *, each: list[dict] | None = None) -> list[Future]:
        """The same ``payload`` to every server, or ``each[i]`` to server ``i``."""
        payloads = each if each is not None else [payload] * len(self.servers)
        return [self._pool.submit(http.request, route, body) for http, body in zip(self.servers, payloads)]

    def call(self, route: str, payload: dict | None = None) -> None:
        """Every server, waited for; a failure is raised as soon as it happens."""
        wait_all(self.submit(route, payload))

    def close(self) -> None:
        # Never wait: a thread stuck in a request to a dead server must not hold the trainer up.
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait_all(futures: list[Future]) -> list:
    """The futures' results; the first failure raises at once, without waiting for the others (which
    may be blocked in a collective the failed one will never join)."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    for future in done:
        future.result()  # raises the failure, if this one failed
    return [future.result() for future in futures]
