"""The loopback OpenAI-compatible endpoint of ``rollout.agent`` (agent.py): one HTTP server per
driver on 127.0.0.1 (a free port), one :class:`Conversation` per trajectory, addressed by the id
in its base URL (``http://127.0.0.1:PORT/<id>/v1``).

Served: ``POST /<id>/v1/chat/completions`` and ``POST /<id>/v1/completions`` (one choice) and
``GET /<id>/v1/models``. A request does not sample by itself: it waits, as the conversation's
pending request, until the driver has sampled the turn with the whole batch (agent.py answers
it). With ``stream: true`` the whole answer comes as server-sent events once sampled: one chunk
with the text (and tool calls), one with the finish reason, then ``[DONE]`` (agent frameworks
that always stream work unchanged; nothing is gained by reading it in pieces). Anything else
(another route, ``n`` > 1, a malformed body, a second request while one is pending) is a 4xx with
an OpenAI-style error body, and the conversation records the problem, so the run stops with one
line even when the agent catches the error.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The model name the endpoint reports; a request's own ``model`` is accepted and ignored.
MODEL_NAME = "polyfsdp-policy"
SUPPORTED = "POST /<id>/v1/chat/completions, POST /<id>/v1/completions and GET /<id>/v1/models"
# The POST routes and the kind of request each is (agent.py answers each in its format).
ROUTES = {"v1/chat/completions": "chat", "v1/completions": "completions"}


class Conversation:
    """One agent's exchange with the endpoint: ``events`` the driver reads (``("request", (kind,
    body))`` with kind ``"chat"`` or ``"completions"``,
    ``("return", value)``, ``("raise", exc)``, ``("bad", message)``), and the pending request's
    reply slot."""

    def __init__(self, cid: str) -> None:
        self.id = cid
        self.events: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.reply: queue.Queue | None = None  # the pending request's slot: (status, body)
        self.closed = False

    def take(self, kind: str, body: dict) -> queue.Queue | str:
        """Register ``body`` (a ``kind`` request) as the pending request: its reply slot, or why it
        is refused."""
        with self.lock:
            if self.closed:
                return "closed"
            if self.reply is not None:
                return "one request at a time per conversation: a request is still pending"
            self.reply = queue.Queue(maxsize=1)
            self.events.put(("request", (kind, body)))
            return self.reply

    def answer(self, status: int, body: dict) -> bool:
        """Answer the pending request (False: none was pending)."""
        with self.lock:
            slot, self.reply = self.reply, None
        if slot is None:
            return False
        slot.put((status, body))
        return True

    def close(self, why: str) -> None:
        """No more requests: the pending one (if any) and later ones get a 400 saying ``why``."""
        with self.lock:
            self.closed, self.why = True, why
        self.answer(400, error_body(why, "conversation_ended"))


def error_body(message: str, code: str = "invalid_request_error") -> dict:
    """An OpenAI-style error response body."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def _sampling_problem(body: dict) -> str | None:
    """Why a request asks for more than one whole choice, or None."""
    if body.get("n") not in (None, 1):
        return f"n={body.get('n')!r}: one choice per request (a trajectory is one conversation; polyfsdp's " \
               f"algo.actor.group_size makes the group)"
    return None


def stream_events(answer: dict) -> list[dict]:
    """A whole (one-choice) answer as the chunks a streamed request gets: the content, then the
    finish reason (a chat answer's tool calls ride in the first chunk's delta, indexed)."""
    choice = answer["choices"][0]
    head = {key: answer[key] for key in ("id", "created", "model")}
    if answer["object"] == "chat.completion":
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        kind, first, last = "chat.completion.chunk", {"delta": delta}, {"delta": {}}
    else:
        kind, first, last = "text_completion", {"text": choice["text"]}, {"text": ""}
    return [{**head, "object": kind, "choices": [{"index": 0, **part, "logprobs": None, "finish_reason": reason}]}
            for part, reason in ((first, None), (last, choice["finish_reason"]))]


def chat_problem(body) -> str | None:
    """Why the engine cannot serve this chat completion body, or None."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of chat messages"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            return f"messages[{i}] is not a chat message with a 'role'"
    if body.get("tools") is not None and not isinstance(body.get("tools"), list):
        return "'tools' must be a list of tool schemas"
    return _sampling_problem(body)


def prompt_text(body: dict) -> str | None:
    """A completion request's prompt: a string, or a list holding one string."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def completion_problem(body) -> str | None:
    """Why the engine cannot serve this (legacy) completion body, or None."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    if prompt_text(body) is None:
        return (f"'prompt' must be one string (got {type(body.get('prompt')).__name__}): a trajectory is one "
                f"text; token-id and batched prompts are not served")
    if body.get("echo"):
        return "echo=true is not supported: the reply is the completion alone"
    if body.get("best_of") not in (None, 1):
        return f"best_of={body.get('best_of')!r}: one choice per request"
    return _sampling_problem(body)


# Each kind of request: what an error line calls it, and its check.
PROBLEMS = {"chat": ("chat completion request", chat_problem),
            "completions": ("completion request", completion_problem)}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # every agent of a round may connect at once (the default backlog is 5)


class AgentServer:
    """The HTTP server; ``conversations`` maps an id to its :class:`Conversation`."""

    def __init__(self) -> None:
        self.conversations: dict[str, Conversation] = {}
        self._lock = threading.Lock()
        self._count = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # no access log on stderr
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                conversation = server.conversations.get(parts[0]) if parts else None
                return conversation, "/".join(parts[1:])

            def do_GET(self) -> None:
                conversation, route = self._route()
                if conversation is not None and route == "v1/models":
                    self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                                 "created": 0, "owned_by": "polyfsdp"}]})
                else:
                    self._refuse(conversation, 404, f"GET /{'/'.join(self.path.strip('/').split('/')[1:])}: "
                                                    f"not served; this endpoint serves {SUPPORTED}")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                conversation, route = self._route()
                if conversation is None:
                    self._send(404, error_body(f"no polyfsdp conversation at {self.path!r}: use the base URL "
                                               f"the agent was given", "not_found"))
                    return
                kind = ROUTES.get(route)
                if kind is None:
                    self._refuse(conversation, 404, f"POST /{route}: not served; this endpoint serves {SUPPORTED}")
                    return
                try:
                    body = json.loads(raw or b"null")
                except ValueError as exc:
                    self._refuse(conversation, 400, f"the request body is not JSON: {exc}")
                    return
                what, check = PROBLEMS[kind]
                problem = check(body)
                if problem is not None:
                    self._refuse(conversation, 400, f"{what}: {problem}")
                    return
                slot = conversation.take(kind, body)
                if slot == "closed":
                    self._send(400, error_body(f"this conversation has ended: {conversation.why}",
                                               "conversation_ended"))
                    return
                if isinstance(slot, str):
                    self._refuse(conversation, 409, slot)
                    return
                status, answer = slot.get()
                if body.get("stream") and status == 200:
                    self._send_events(stream_events(answer))
                else:
                    self._send(status, answer)

            def _send_events(self, events: list[dict]) -> None:
                """Server-sent events, then ``[DONE]``; the connection closes after them (no length)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in events:
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def _refuse(self, conversation, status: int, message: str) -> None:
                if conversation is not None and not conversation.closed:
                    conversation.events.put(("bad", f"sent a request the endpoint cannot serve ({message})"))
                self._send(status, error_body(message))

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="agent-endpoint")
        self._thread.start()

    def open(self) -> Conversation:
        """A new conversation and its id (the path segment of its base URL)."""
        with self._lock:
            self._count += 1
            conversation = Conversation(f"t{self._count}-{int(time.time() * 1000) % 100000}")
            self.conversations[conversation.id] = conversation
        return conversation

    def base_url(self, conversation: Conversation) -> str:
        return f"http://127.0.0.1:{self.port}/{conversation.id}/v1"

    def drop(self, conversation: Conversation, why: str) -> None:
        """End ``conversation`` (its pending request answered with a 400) and forget it."""
        conversation.close(why)
        with self._lock:
            self.conversations.pop(conversation.id, None)

    def stop(self) -> None:
        for conversation in list(self.conversations.values()):
            self.drop(conversation, "the rollout endpoint stopped")
        self.httpd.shutdown()
        self.httpd.server_close()
