"""``rollout.agent``: agents from any framework, talking to the rollout engine through an
OpenAI-compatible endpoint on loopback (agent_server.py), with token-exact trajectories.

``rollout.agent=FILE.py:fn`` or ``module:fn`` names ``fn(example, client) -> reward`` (a number,
or a dict with ``"reward"``): a plain function gets an ``openai.OpenAI`` client, an ``async def``
an ``openai.AsyncOpenAI``, each with its conversation's base URL. Every agent runs on its own
thread, at most ``rollout.agent_concurrency`` conversations at once.

The agent is an environment (environments.py) to the multi-turn driver (multi_turn.py), which
keeps its bookkeeping: the tokens the sampler drew are the trajectory's (loss mask 1, the
sampler's log-probs), the messages the agent adds between two of its requests are rendered by
the chat template after the assistant turn (loss mask 0), per-row turn seeds, the turn and token
limits. :class:`AgentEnv`: ``reset`` starts the agent and waits for its first request, whose
messages (and ``tools``) are the prompt; ``step(text)`` answers the pending request with the
sampled text (and its tool calls in OpenAI's format) and waits for the next request, whose
messages after its last assistant message are the environment's turn, or for the agent's return,
its reward. Sampling settings in a request (model, temperature, max_tokens, seed, ...) are
ignored: the trainer's (``algo.actor``) and the row's seed decide.

A conversation that begins with ``/v1/completions`` is plain text (:class:`TextTurns`): its first
prompt is ``<bos>`` and the prompt's tokens, as a plain-text data prompt; each later prompt must
extend the previous one and the sampled completion, and what it adds is the environment's turn,
its tokens with no template around them. One kind of request per conversation.

Re-tokenization: the history the agent sends back is compared with the one sampled (the prompt,
each returned assistant message, each message passed on, the tools; a completion prompt: the text
so far); a conversation where they differ is counted (``agent/retokenization_mismatch``, the
share of conversations) and trained on the sampled tokens, never on the agent's edited text (with
an edited completion prompt, what follows the text it shares with the sampled one is the turn).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import queue
import threading
import time

from polyfsdp.backends.distributed import current_rank

from ...config.plugins import first_line, load_object
from ...errors import ConfigError, RewardError
from ...rewards.reward_fn import user_frame
from ..environments import EnvStep, is_finite_reward, parse_tool_calls
from .agent_server import MODEL_NAME, AgentServer, prompt_text
from .multi_turn import ChatTurns, MultiTurnDriver, TextTurns, Trajectory
from .result import refuse_images

API_KEY = "polyfsdp-local"  # the endpoint checks no key; clients insist on one
logger = logging.getLogger(__name__)


class AgentFailure(Exception):
    """What went wrong with an agent (the driver adds the agent, the record and the turn)."""


def openai_module():
    """The ``openai`` package, or a one-line ConfigError naming the install."""
    try:
        import openai
    except ImportError:
        raise ConfigError("rollout.agent needs the openai package for its client: pip install openai") from None
    return openai


def load_agent(spec: str, env_kwargs: dict | None = None):
    """The agent function ``rollout.agent`` names (``FILE.py:fn`` or ``module:fn``; ``verifiers:ENV_ID``
    with ``rollout.env_kwargs``: verifiers_agent.py)."""
    openai_module()
    if spec.startswith("verifiers:"):
        from .verifiers_agent import verifiers_agent

        return verifiers_agent(spec, env_kwargs)
    fn = load_object(spec, "rollout.agent", {}, what="function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # no signature to read: a mismatch shows at the first call
    try:
        signature.bind("example", "client")
    except TypeError as exc:
        raise ConfigError(f"rollout.agent={spec}: {getattr(fn, '__name__', 'the function')}{signature} cannot be called "
                          f"as fn(example, client) ({exc})") from None
    return fn


def _text(content) -> str:
    """A message's content as text (None: empty; a list of parts: their text joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _calls_key(calls) -> list:
    out = []
    for call in calls or []:
        function = (call or {}).get("function") or {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        out.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return out


def _key(message: dict) -> tuple:
    """What must match between the agent's history and the sampled one."""
    return message.get("role"), _text(message.get("content")), _calls_key(message.get("tool_calls"))


def _for_template(message: dict) -> dict:
    """A message the chat template renders: role and text content (and name / tool_call_id)."""
    out = {"role": message["role"], "content": _text(message.get("content"))}
    for extra in ("name", "tool_call_id"):
        if isinstance(message.get(extra), str):
            out[extra] = message[extra]
    return out


def reported_metrics(value) -> dict[str, float]:
    """A dict return's other finite numbers (``{"reward": 1, "tool_uses": 3}``: tool_uses), logged
    as ``agent/<key>``, averaged over the conversations that report it; anything else is left out."""
    if not isinstance(value, dict):
        return {}
    return {str(key): float(v) for key, v in value.items() if key != "reward" and is_finite_reward(v)
            and not isinstance(v, bool) and str(key) != "retokenization_mismatch"}


def as_reward(value) -> float:
    """The agent's return as a finite reward (a number, or a dict with ``"reward"``)."""
    reward = value.get("reward") if isinstance(value, dict) else value
    if not is_finite_reward(reward):
        raise AgentFailure(f"returned {value!r}; expected a finite number or a dict with a finite 'reward'")
    return float(reward)


class AgentEnv:
    """One agent conversation as an environment (the module doc)."""

    def __init__(self, driver: "AgentDriver") -> None:
        self.driver, self.tools, self.kind, self.text = driver, [], "chat", ""
        self.conversation, self.history, self.mismatch, self.finish_reason = None, [], False, "stop"
        self.reported: dict[str, float] = {}  # the agent's metrics (reported_metrics)
        self.cut = ""  # the limit that ended the conversation (multi_turn.Trajectory.cut)
        self.thread: threading.Thread | None = None
        self.sent = False

    def launch(self, example) -> None:
        """Start the agent on its own thread (reset waits for its first request)."""
        self.conversation = self.driver.server.open()
        events, fn = self.conversation.events, self.driver.agent
        openai = openai_module()
        import httpx  # openai's own HTTP library

        # Plain HTTP on loopback: no certificates to load (45 ms a client otherwise), no proxy from
        # the environment; a request waits for the whole batch's turn, so no client-side timeout.
        http = dict(verify=False, trust_env=False, timeout=None)
        options = dict(base_url=self.driver.server.base_url(self.conversation), api_key=API_KEY, max_retries=0)

        def run():
            try:
                if inspect.iscoroutinefunction(fn):
                    async def main():
                        async with openai.AsyncOpenAI(**options, http_client=httpx.AsyncClient(**http)) as client:
                            return await fn(example, client)
                    value = asyncio.run(main())
                else:
                    with openai.OpenAI(**options, http_client=httpx.Client(**http)) as client:
                        value = fn(example, client)
                events.put(("return", value))
            except BaseException as exc:  # noqa: BLE001 - reported on the driver's thread
                events.put(("raise", exc))

        self.thread = threading.Thread(target=run, daemon=True, name=f"agent-{self.conversation.id}")
        self.thread.start()

    def _next(self, first: bool):
        """The agent's next event: ``("request", body)`` or ``("return", value)``; failures raise."""
        timeout = self.driver.settings.timeout_s
        try:
            kind, value = self.conversation.events.get(timeout=timeout)
        except queue.Empty:
            raise AgentFailure(f"neither called the model nor returned within rollout.env_timeout_s={timeout:g} s; "
                               f"make it faster or raise rollout.env_timeout_s") from None
        if kind == "raise":
            if isinstance(value, SystemExit):
                raise AgentFailure(f"called sys.exit({value.code!r}); it must return, not end the process")
            raise AgentFailure(f"raised {type(value).__name__}: {first_line(value)}{user_frame(value)}")
        if kind == "bad":
            raise AgentFailure(value)
        if kind == "return" and first:
            raise AgentFailure(f"returned {value!r} before calling the model: an agent must ask the endpoint for "
                               f"at least one completion (nothing to train on otherwise)")
        return kind, value

    def reset(self, example) -> list:
        if self.conversation is None:
            self.launch(example)
        _, (self.kind, body) = self._next(first=True)
        if self.kind == "completions":
            self.text = prompt_text(body)
            return [{"role": "user", "content": self.text}]
        messages = body["messages"]
        self.tools = list(body.get("tools") or [])
        self.history = [_key(m) for m in messages]
        return [_for_template(m) for m in messages]

    def send(self, text: str, finish_reason: str) -> None:
        """Answer the pending request with the sampled ``text`` (and its tool calls)."""
        if self.kind == "completions":
            self.text += text
            self._reply("cmpl", "text_completion", {"text": text, "finish_reason": finish_reason}, len(self.text))
            return
        calls = [c for c in parse_tool_calls(text) if c["name"]]
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [{"id": f"call_{self.conversation.id}_{len(self.history)}_{i}",
                                      "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                     for i, c in enumerate(calls)]
        self.history.append(_key(message))
        reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        self._reply("chatcmpl", "chat.completion", {"message": message, "finish_reason": reason}, len(self.history))

    def _reply(self, prefix: str, kind: str, choice: dict, serial: int) -> None:
        """A 200 with the one ``choice``, in OpenAI's response format for ``kind``."""
        self.conversation.answer(200, {"id": f"{prefix}-{self.conversation.id}-{serial}", "object": kind,
                                       "created": int(time.time()), "model": MODEL_NAME,
                                       "choices": [{"index": 0, **choice, "logprobs": None}]})
        self.sent = True

    def step(self, assistant_text: str) -> EnvStep:
        if not self.sent:
            self.send(assistant_text, self.finish_reason)
        self.sent = False
        kind, value = self._next(first=False)
        if kind == "return":
            self.reported = reported_metrics(value)
            return EnvStep([], as_reward(value), True)
        request_kind, body = value
        if request_kind != self.kind:
            raise AgentFailure(f"sent a {request_kind} request in a conversation it began with {self.kind} requests: "
                               f"one kind per conversation (its tokens so far are rendered for that kind)")
        if self.kind == "completions":
            return EnvStep([{"role": "user", "content": self._added_text(prompt_text(body))}], 0.0, False)
        messages = body["messages"]
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None or [_key(m) for m in messages[:last + 1]] != self.history or \
                list(body.get("tools") or []) != self.tools:
            self.mismatch = True  # the agent's history is not what was sampled: the sampled tokens stay
        new = messages[last + 1:] if last is not None else messages
        self.history += [_key(m) for m in new]
        return EnvStep([_for_template(m) for m in new], 0.0, False)

    def _added_text(self, prompt: str) -> str:
        """What a completion prompt adds to the text so far (the prompt, the completions, the
        texts added before); a prompt that does not extend it is counted, and what follows the
        text both share is the turn. The agent's prompt is the text so far from here on."""
        if prompt.startswith(self.text):
            added = prompt[len(self.text):]
        else:
            self.mismatch = True
            added = prompt[len(os.path.commonprefix([self.text, prompt])):]
        self.text = prompt
        return added


class AgentDriver(MultiTurnDriver):
    """The multi-turn driver over agents: ``settings.env`` is the agent spec (for error lines)."""

    label_key = "rollout.agent"

    def __init__(self, engine, settings, max_positions, concurrency: int = 64) -> None:
        self.agent = load_agent(settings.env, settings.env_kwargs)
        self.concurrency = concurrency
        super().__init__(engine, settings, max_positions, env_class=lambda **_: AgentEnv(self))
        self._deadline = None  # the agent runs on its own thread: AgentEnv's waits time it
        self.server: AgentServer | None = None
        self._warned = False

    def renderer(self, env, tokenizer, previous):
        """Each conversation's own renderer: plain text, or the chat template with the tools of
        its first request (conversations with the same tools share one)."""
        if env.kind == "completions":
            return TextTurns(tokenizer)
        if isinstance(previous, ChatTurns) and previous.tokenizer is tokenizer and \
                (previous.tools or []) == env.tools:
            return previous
        return ChatTurns(tokenizer, env.tools)

    def _env_call(self, trajectory, method: str, turn: int, call, check):
        record = trajectory.example.where or f"with prompt {trajectory.example.prompt!r}"
        try:
            result = call()
        except AgentFailure as exc:
            raise RewardError(f"rollout.agent={self.settings.env} {exc} (record {record}, turn {turn})") from None
        try:
            return check(result, f"rollout.agent={self.settings.env}")
        except ValueError as exc:
            raise RewardError(f"{exc} (record {record}, turn {turn})") from None

    def start(self, examples, n: int, tokenizer):
        """Every agent starts at once (each on its thread), then their first requests are read."""
        refuse_images(examples, self.label_key, self.settings.env)
        if self.server is None:
            self.server = AgentServer()
        envs = []
        for example in examples:
            for _ in range(n):
                env = AgentEnv(self)
                env.launch(example)
                envs.append(env)
        self._live = envs
        pending = iter(envs)
        self.env_class = lambda **_: next(pending)
        try:
            return super().start(examples, n, tokenizer)
        finally:
            self.env_class = lambda **_: AgentEnv(self)

    def deliver(self, active, completions, tokenizer, params) -> None:
        """Answer every agent's pending request before reading any reply: agents run in parallel."""
        stop_ids = set(params.stop_token_ids)
        for t, tokens in zip(active, completions):
            stopped = bool(tokens) and tokens[-1] in stop_ids
            reason = "stop" if stopped or len(tokens) < params.max_new_tokens else "length"
            t.env.send(tokenizer.decode(tokens), reason)

    def finish(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        by_turns = 0
        for t in trajectories:
            t.env.cut = t.cut  # the 400 its next request gets says which limit (_close_live)
            by_turns += t.cut.startswith("rollout.max_turns")
        if by_turns and not self._warned and current_rank() == 0:
            self._warned = True  # once a run: the share is in multi_turn/truncated_mean
            logger.warning("rollout.agent=%s: %d of %d conversations asked the model again after "
                           "rollout.max_turns=%d turns and were cut (rewarded 0); raise rollout.max_turns if "
                           "the agent needs more turns", self.settings.env, by_turns, len(trajectories),
                           self.settings.max_turns)
        metrics = {"agent/retokenization_mismatch": [float(t.env.mismatch) for t in trajectories]}
        for t in trajectories:
            for key, value in t.env.reported.items():
                metrics.setdefault(f"agent/{key}", []).append(value)
        return metrics

    def _close_live(self) -> None:
        for env in getattr(self, "_live", []):
            if env.conversation is not None:
                why = env.cut or "rollout.max_turns, algo.actor.max_new_tokens or rollout.max_total_tokens"
                self.server.drop(env.conversation, f"polyfsdp ended the conversation ({why}); it is rewarded 0")
        self._live = []

    def rollout(self, tokenizer, examples, n, params, scorer=None, with_answers=False, row_seeds=None, device=None):
        """The multi-turn rollout, ``rollout.agent_concurrency`` conversations at a time (whole
        groups: at least one example's ``n``); every rank takes as many rounds as the busiest."""
        from polyfsdp.backends.distributed import all_reduce_max, current_world_size

        from ..sampling import concat_rollouts

        per = max(1, self.concurrency // max(1, n))
        chunks = [examples[i:i + per] for i in range(0, len(examples), per)] or [[]]
        rounds = len(chunks)
        if current_world_size() > 1:
            rounds = int(all_reduce_max([float(rounds)], device)[0])
        chunks += [[]] * (rounds - len(chunks))
        parts, done = [], 0
        for chunk in chunks:
            seeds = None if row_seeds is None else row_seeds[done * n:(done + len(chunk)) * n]
            try:
                parts.append(super().rollout(tokenizer, chunk, n, params, scorer, with_answers, seeds, device))
            finally:
                self._close_live()
            done += len(chunk)
        return concat_rollouts([p for p in parts if p.prompt_ids] or parts[:1])

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
