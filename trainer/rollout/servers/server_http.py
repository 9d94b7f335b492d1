"""POSTs to vLLM servers' control routes with the standard library, failing in one line.

A failure names the server URL, the route and the server's own error text, so a failed weight sync
says which server refused what; never a traceback through urllib.
"""
import json
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait


class ServerRequestError(RuntimeError):
    """A control route answered with an error, or could not be reached in time."""


def _one_line(text: str, limit: int = 500) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def _error_text(body: bytes) -> str:
    """The message out of vLLM's (``{"error": {"message": ...}}``) or FastAPI's (``{"detail": ...}``)
    error bodies; the raw body otherwise."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)
    return text


def post(url: str, route: str, payload: dict | None, timeout_s: float) -> dict:
    """POST ``payload`` as JSON to ``url + route`` (route with its query, e.g. ``/pause?mode=keep``)."""
    target = url.rstrip("/") + route
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(target, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        detail = _one_line(f"HTTP {err.code}: {_error_text(err.read())}")
        raise ServerRequestError(f"vLLM server {url} {route} failed: {detail}") from None
    except (urllib.error.URLError, OSError) as err:  # refused, unresolvable, timed out
        reason = getattr(err, "reason", err)
        raise ServerRequestError(f"vLLM server {url} {route} failed: {_one_line(str(reason))}") from None
    return json.loads(body) if body else {}


class Fanout:
    """Sends one route to every server at once (the routes block until their workers are done, and
    the workers of all servers must be inside the same collective together)."""

    def __init__(self, urls: list[str], timeout_s: float):
        self.urls, self.timeout_s = list(urls), timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="vllm-post")

    def submit(self, route: str, payload: dict | None = None, *, each: list[dict] | None = None) -> list[Future]:
        """The same ``payload`` to every server, or ``each[i]`` to server ``i``."""
        payloads = each if each is not None else [payload] * len(self.urls)
        return [self._pool.submit(post, url, route, body, self.timeout_s) for url, body in zip(self.urls, payloads)]

    def call(self, route: str, payload: dict | None = None) -> None:
        """All servers, waited for; a failure is raised as soon as it happens."""
        wait_all(self.submit(route, payload))

    def close(self) -> None:
        # Never wait: a thread stuck in a request to a dead server must not hold the trainer up.
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait_all(futures: list[Future]) -> list:
    """The futures' results; the first failure raises at once, without waiting for the others (which
    may be blocked in a collective that the failed one will never join)."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    for future in done:
        future.result()  # raises the failure, if this one failed
    return [future.result() for future in futures]
