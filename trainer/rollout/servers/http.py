"""JSON over HTTP to one rollout server (standard library only: the trainer needs no HTTP package).

Every failure is a :class:`ServerError` of one line naming the server, the route and what the
server said, so a user with several servers knows which one to look at; for a server polyfsdp
started, also its log and the root cause found there (``explain``: server_log.py).

Every request is bounded (trainer/deadline_http.py, as the reward judge's): its timeout is one
overall deadline over connecting, sending, the status line, the headers and the whole answer (a
server dripping bytes cannot stretch it; a per-read timeout let one byte every few seconds keep a
request alive for ever), and its answer is read up to an :class:`AnswerCap`, what the request can
produce, never the whole body: a larger one is refused in one line. The cap of a completion is
sized by its prompt and ``max_tokens`` (completions.py: ``completion_cap``); every other route
(health, ``/server_info``, ``/v1/models``, the weight-transfer and version routes) answers a few
hundred bytes to a few KiB: :data:`CONTROL_ANSWER`. Requests run on daemon threads and the main
thread's waits read the job's stop flag (trainer/network_waits.py): a SIGTERM or Ctrl-C ends a run
whose server is not answering.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import Future
from typing import Callable, NamedTuple

from ...deadline_http import AnswerTooLarge, HttpStatus, fetch
from ...errors import ConfigError
from ...network_waits import DaemonPool, wait_or_stop


class ServerError(ConfigError):
    """A rollout server that did not start, died, timed out or answered something unusable."""


class AnswerCap(NamedTuple):
    """The most bytes read of an answer (more is refused), and what sized it (said when refused)."""

    limit: int
    sized_by: str


# The control routes' answers: /health (empty), /v1/models (one model: ~300 bytes), /server_info
# (the engine's config as text: ~10 KiB on vLLM 0.3x), /weight_info, /get_world_size and the
# weight-transfer routes (a few bytes of JSON). 4 MiB is hundreds of times any of them.
CONTROL_ANSWER = AnswerCap(4 << 20, "a control route's answer (rollout servers answer these in a few KiB)")
# /health, asked every second while a started server loads: a probe that takes longer says "not yet".
HEALTH_TIMEOUT_S = 5.0


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
    ``timeout_s``: each request's overall deadline (``rollout.server.request_timeout_s``).
    ``explain``: for a server polyfsdp started, what completes a failure's line (its
    ServerProcess's ``explain_failure``: the exit code, the log and its root cause); None: the line
    as it is (a server someone else started, whose log is not ours to read)."""

    def __init__(self, url: str, name: str, timeout_s: float, explain: Explain | None = None) -> None:
        self.url, self.name, self.timeout_s = url.rstrip("/"), name, timeout_s
        self.explain = explain

    def failure(self, what: str) -> ServerError:
        """The ServerError of a failure of this server (``what``: one line naming it)."""
        return ServerError(self.explain(what) if self.explain is not None else what)

    def request(self, route: str, payload: dict | None = None, method: str = "POST", timeout_s: float | None = None,
                cap: AnswerCap = CONTROL_ANSWER):
        """The decoded JSON answer of ``route`` (None for an empty body), all of it within
        ``timeout_s`` (default: the server's) and at most ``cap.limit`` bytes; ServerError otherwise."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"{self.url}{route}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        where = f"{self.name} ({self.url}) {method} {route.split('?')[0]}"
        timeout_s = timeout_s or self.timeout_s
        late = f"{where}: no answer within {timeout_s:g} s (rollout.server.request_timeout_s)"
        try:
            body = fetch(req, timeout_s, max_bytes=cap.limit)
        except HttpStatus as exc:
            raise self.failure(f"{where}: HTTP {exc.code}: {server_text(exc.body)}") from None
        except AnswerTooLarge:
            raise self.failure(f"{where}: the answer is over {cap.limit} bytes, the most read for {cap.sized_by}; "
                               f"is it a vLLM OpenAI server started as docs/rollouts-and-servers.md says?") from None
        except TimeoutError:
            raise self.failure(late) from None
        except (urllib.error.URLError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):  # the deadline passed while connecting
                raise self.failure(late) from None
            raise self.failure(f"{where}: not reachable ({reason}); is the server running and the address "
                               f"right?") from None
        if not body.strip():
            return None
        try:
            return json.loads(body)
        except ValueError:
            raise self.failure(f"{where}: answered something that is not JSON: {server_text(body)}") from None

    def healthy(self) -> bool:
        """Whether ``/health`` answers a success now, within ``HEALTH_TIMEOUT_S`` (no error: a server
        still starting, or one that does not answer in time, is not healthy)."""
        try:
            fetch(urllib.request.Request(f"{self.url}/health"), HEALTH_TIMEOUT_S, max_bytes=CONTROL_ANSWER.limit)
            return True
        except (urllib.error.URLError, HttpStatus, AnswerTooLarge, OSError):  # OSError: timeouts, resets
            return False


def servers_named(servers: list[ServerHttp]) -> str:
    """The servers as a stop line names what it waited for: ``rollout server 0 (URL)``, or all of them."""
    if len(servers) == 1:
        return f"{servers[0].name} ({servers[0].url})"
    return f"the rollout servers ({', '.join(http.url for http in servers)})"


class Fanout:
    """One route to every server at once: weight-transfer routes block until the server's workers
    are done, and the workers of all servers must be inside the same collective together."""

    def __init__(self, urls: list[str], timeout_s: float, explain: list[Explain | None] | None = None):
        explain = explain or [None] * len(urls)
        self.servers = [ServerHttp(url, f"rollout server {i}", timeout_s, how)
                        for i, (url, how) in enumerate(zip(urls, explain))]
        self.what = servers_named(self.servers)
        # Daemon threads: one blocked on a server that does not answer never holds the process's exit.
        self._pool = DaemonPool(max(1, len(self.servers)), "server-post")

    def submit(self, route: str, payload: dict | None = None, *, each: list[dict] | None = None) -> list[Future]:
        """The same ``payload`` to every server, or ``each[i]`` to server ``i``."""
        payloads = each if each is not None else [payload] * len(self.servers)
        return [self._pool.submit(http.request, route, body) for http, body in zip(self.servers, payloads)]

    def call(self, route: str, payload: dict | None = None) -> None:
        """Every server, waited for; a failure is raised as soon as it happens."""
        wait_all(self.submit(route, payload), self.what)

    def close(self) -> None:
        # Never wait: a thread stuck in a request to a dead server must not hold the trainer up.
        self._pool.close()


def wait_all(futures: list[Future], what: str = "the rollout servers") -> list:
    """The futures' results; the first failure raises at once, without waiting for the others (which
    may be blocked in a collective the failed one will never join). On the main thread a SIGTERM
    raises StoppedWhileWaiting (``what``: the servers waited for) and Ctrl-C KeyboardInterrupt."""
    return wait_or_stop(futures, what)
