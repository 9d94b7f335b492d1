"""``reward.judge``: a generative judge scores each completion through an OpenAI-compatible server.

The judge's prompt is ``reward.judge.template`` with ``{prompt}``, ``{response}`` and
``{ground_truth}`` filled from the record and the completion; it is sent as one user message
(``api: chat``, the server's chat template renders it) or as plain text (``api: completions``),
sampled greedily (temperature 0, ``max_tokens``), and its verdict is parsed into a score:

- ``parse: number``: the first number in the verdict (``"Score: 7/10"`` -> 7);
- ``parse: labels``: ``labels`` maps words to scores; the label that appears first in the verdict
  (whole words, any case: ``correct`` is not found inside ``incorrect``) gives the score;
- ``parse: regex``: ``pattern``'s first group (or the whole match) is a number, or a label when
  ``labels`` is given.

A verdict that does not parse follows ``on_unparsable``: ``zero`` scores it 0, ``error`` stops the
run with one line naming the record and the verdict, ``skip`` gives the row its group's mean of
the parsed scores (the judge then adds nothing to its advantage; 0 when none of the group parsed).
``reward/judge_unparsable`` logs the share that did not parse. Requests run ``concurrency`` at a
time per rank; a request that fails to connect or gets a 5xx is tried ``retries`` more times
(1 s, 2 s, ... apart); anything else, or the last failure, is one line naming the judge and the
record. The server is ``url`` (any OpenAI-compatible base URL, e.g. ``http://host:8000/v1``), or
the vLLM server polyfsdp starts for ``checkpoint`` (judge_server.py).

Every request is bounded (trainer/deadline_http.py): ``timeout_s`` is its overall deadline
(connecting, sending, the status line, the headers and the whole answer; a server dripping bytes
cannot stretch it), and its answer is read up to :func:`answer_cap` bytes, what ``max_tokens``
tokens can take, never the whole body: a larger answer is refused in one line. The requests run on
daemon threads and the main thread's wait reads the job's stop flag (trainer/network_waits.py), so
SIGTERM or Ctrl-C ends a run whose judge is not answering.
"""
from __future__ import annotations

import json
import re
import string
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, fields

from polyfsdp.engines.config import setting

from ..deadline_http import AnswerTooLarge, HttpStatus, fetch
from ..errors import ConfigError, RewardError
from ..network_waits import DaemonPool, wait_or_stop
from ..rollout.servers.http import server_text

DEFAULT_TEMPLATE = ("Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
                    "Is the response correct? Answer with a score from 0 to 10.")
PARSERS = ("number", "labels", "regex")
ON_UNPARSABLE = ("zero", "error", "skip")
TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
# What one verdict's answer may take (answer_cap). A token's text is a few characters (about 4 on
# average; the longest vocabulary entries, runs of spaces or symbols, tens), each 1 to 6 bytes once
# JSON escapes it (\uXXXX): 256 bytes a token is far above what a verdict averages. The envelope
# (id, model, usage, finish_reason, ...) is under 1 KiB on vLLM and OpenAI; 64 KiB leaves room for
# servers that add more, and for a few unusually long tokens.
ANSWER_BYTES_PER_TOKEN = 256
ANSWER_ENVELOPE_BYTES = 64 << 10
# The model listing (GET /models) when reward.judge.model is null: OpenAI's own lists ~100 models in ~10 KiB.
LISTING_MAX_BYTES = 1 << 20


def answer_cap(max_tokens: int) -> int:
    """The most bytes read of a verdict's answer (more is refused)."""
    return ANSWER_ENVELOPE_BYTES + ANSWER_BYTES_PER_TOKEN * max_tokens


class JudgeUnavailable(RewardError):
    """A judge request that failed for good (after its retries)."""


@dataclass(frozen=True)
class JudgeSettings:
    """``reward.judge`` (the module doc says what each key does)."""

    url: str | None = setting(None, doc="an OpenAI-compatible server's base URL, e.g. http://host:8000/v1 "
                                        "(or checkpoint)")
    checkpoint: str | None = setting(None, doc="a model directory polyfsdp serves with vLLM for the judge (or url)")
    model: str | None = setting(None, doc="the model name sent; null: the server's first /v1/models entry")
    template: str = setting(DEFAULT_TEMPLATE, doc="the judge's prompt, with {prompt}, {response} and {ground_truth}")
    api: str = setting("chat", doc="chat (one user message, the server's chat template) or completions (plain text)")
    parse: str = setting("number", doc="number (the verdict's first number), labels or regex")
    labels: dict | None = setting(None, doc="words to scores for parse=labels (or a regex's group), e.g. "
                                            "{correct: 1, incorrect: 0}")
    pattern: str | None = setting(None, doc="parse=regex: its first group (or the match) is the score or a label")
    max_tokens: int = setting(64, doc="the verdict's length (greedy)")
    timeout_s: float = setting(60.0, doc="one request's limit")
    retries: int = setting(2, doc="more tries of a request that fails to connect or gets a 5xx (1 s, 2 s, ... apart)")
    concurrency: int = setting(8, doc="requests in flight per rank")
    on_unparsable: str = setting("zero", doc="a verdict that does not parse: zero, error (stop) or skip (its "
                                             "group's mean)")
    gpu_memory_utilization: float = setting(0.2, doc="checkpoint on a device: the judge server's share")
    start_timeout_s: float = setting(600.0, doc="checkpoint: how long its server may take to start")
    name: str = setting("judge", doc="its place among the reward's sources: logged as reward/<name>")
    weight: float = setting(1.0, doc="its weight in the reward's sum")
    data_sources: list | None = setting(None, doc="the records' data_source values it scores; null: all")

    @classmethod
    def from_section(cls, section) -> "JudgeSettings":
        """The settings of a ``reward.judge`` mapping, every problem one ConfigError naming its key."""
        if not isinstance(section, dict):
            raise ConfigError(f"reward.judge: expected a mapping (url or checkpoint, template, parse, ...), got "
                              f"{section!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ConfigError(f"reward.judge.{unknown[0]}: not a judge setting (known: {', '.join(known)})")
        settings = cls(**{k: v for k, v in section.items() if v is not None})
        settings.check()
        return settings

    def check(self) -> None:
        if (self.url is None) == (self.checkpoint is None):
            raise ConfigError("reward.judge: set one of url (an OpenAI-compatible server, e.g. http://host:8000/v1) "
                              "or checkpoint (a model directory polyfsdp serves with vLLM)")
        for key, value, allowed in (("api", self.api, ("chat", "completions")), ("parse", self.parse, PARSERS),
                                    ("on_unparsable", self.on_unparsable, ON_UNPARSABLE)):
            if value not in allowed:
                raise ConfigError(f"reward.judge.{key}={value!r}: expected one of {', '.join(allowed)}")
        for key, low in (("max_tokens", 1), ("retries", 0), ("concurrency", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"reward.judge.{key}: expected an int >= {low}, got {value!r}")
        for key in ("timeout_s", "start_timeout_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"reward.judge.{key}: expected a number of seconds > 0, got {value!r}")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or abs(self.weight) > 1e3:
            raise ConfigError(f"reward.judge.weight: expected a number within +-1000, got {self.weight!r}")
        if not isinstance(self.name, str) or not self.name.replace("_", "").isalnum() or self.name == "fn":
            raise ConfigError(f"reward.judge.name: got {self.name!r}; expected letters, digits and _ (not 'fn', "
                              f"reward.fn's name)")
        share = self.gpu_memory_utilization
        if not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(f"reward.judge.gpu_memory_utilization: expected a share in (0, 1], got {share!r}")
        self._check_template()
        if self.labels is not None:
            if not isinstance(self.labels, dict) or not self.labels or \
                    not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.labels.values()):
                raise ConfigError(f"reward.judge.labels: expected a mapping of words to scores, got {self.labels!r}")
        if self.parse == "labels" and not self.labels:
            raise ConfigError("reward.judge.parse=labels needs reward.judge.labels (e.g. {correct: 1, incorrect: 0})")
        if self.parse == "regex":
            if not isinstance(self.pattern, str):
                raise ConfigError("reward.judge.parse=regex needs reward.judge.pattern (e.g. 'Score: (\\d+)')")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ConfigError(f"reward.judge.pattern={self.pattern!r}: not a regular expression ({exc})") from None
        if self.parse != "number" and self.template == DEFAULT_TEMPLATE:
            raise ConfigError(f"reward.judge.parse={self.parse}: the default template asks for a score from 0 to 10; "
                              f"set reward.judge.template to ask for what the parser reads")

    def _check_template(self) -> None:
        if not isinstance(self.template, str):
            raise ConfigError(f"reward.judge.template: expected a string, got {self.template!r}")
        try:
            named = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        except ValueError as exc:
            raise ConfigError(f"reward.judge.template: {exc} (a literal brace is written {{{{ or }}}})") from None
        wrong = sorted(named - set(TEMPLATE_FIELDS))
        if wrong:
            raise ConfigError(f"reward.judge.template: unknown field {{{wrong[0]}}} (the fields are "
                              f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)})")
        if "response" not in named:
            raise ConfigError("reward.judge.template: it never shows the judge the {response}")


def parse_verdict(text: str, settings: JudgeSettings) -> float | None:
    """The score a verdict gives, or None when it does not parse."""
    if settings.parse == "regex":
        match = re.search(settings.pattern, text)
        if match is None:
            return None
        text = match.group(1) if match.groups() else match.group(0)
        if settings.labels:
            return _label(text, settings.labels)
        number = _NUMBER.fullmatch(text.strip())
        return float(number.group(0)) if number else None
    if settings.parse == "labels":
        return _label(text, settings.labels)
    number = _NUMBER.search(text)
    return float(number.group(0)) if number else None


def _label(text: str, labels: dict) -> float | None:
    """The score of the label found first in ``text`` (whole words, any case)."""
    found = []
    for label, score in labels.items():
        match = re.search(rf"(?<!\w){re.escape(str(label))}(?!\w)", text, flags=re.IGNORECASE)
        if match:
            found.append((match.start(), -len(str(label)), float(score)))
    return min(found)[2] if found else None


class Judge:
    """A reward source (trainer/rewards/sources.py) that scores through the judge's server."""

    def __init__(self, settings: JudgeSettings, url: str, server=None) -> None:
        self.settings, self.url, self.server = settings, url.rstrip("/"), server  # server: judge_server's
        self.name, self.weight, self.data_sources = settings.name, float(settings.weight), settings.data_sources
        self.model = settings.model
        self._pool = DaemonPool(settings.concurrency, "reward-judge")

    def _post(self, route: str, payload: dict | None, record: str):
        """The JSON answer of ``route`` (GET without a payload), with the retries of the module doc."""
        where = f"reward.judge ({self.url}) {'POST' if payload is not None else 'GET'} {route}"
        data = None if payload is None else json.dumps(payload).encode()
        cap = LISTING_MAX_BYTES if payload is None else answer_cap(self.settings.max_tokens)
        for attempt in range(self.settings.retries + 1):
            request = urllib.request.Request(f"{self.url}{route}", data=data,
                                             headers={"Content-Type": "application/json"} if data else {})
            try:
                return json.loads(fetch(request, self.settings.timeout_s, max_bytes=cap))
            except HttpStatus as exc:
                problem, again = f"HTTP {exc.code}: {server_text(exc.body)}", exc.code >= 500
            except (urllib.error.URLError, ConnectionError) as exc:
                problem, again = f"not reachable ({getattr(exc, 'reason', exc)})", True
            except TimeoutError:
                problem, again = f"no answer within reward.judge.timeout_s={self.settings.timeout_s:g} s", False
            except AnswerTooLarge:
                problem, again = self._too_large(payload is None), False
            except ValueError:
                problem, again = "answered something that is not JSON", False
            gone = self.server.died() if self.server is not None else None
            if gone is not None:
                raise JudgeUnavailable(f"{gone} ({record})")
            if not again or attempt == self.settings.retries:
                tries = f" after {attempt + 1} tries" if attempt else ""
                raise JudgeUnavailable(f"{where}: {problem}{tries} ({record})")
            time.sleep(attempt + 1)

    def _too_large(self, listing: bool) -> str:
        """What a refused answer's line says: the cap, and the key that moves it."""
        if listing:
            return (f"the model listing is over {LISTING_MAX_BYTES} bytes, the most read; set reward.judge.model "
                    f"(no listing is asked for then)")
        tokens = self.settings.max_tokens
        return (f"the answer is over {answer_cap(tokens)} bytes, the most read for reward.judge.max_tokens={tokens} "
                f"({ANSWER_ENVELOPE_BYTES} + {ANSWER_BYTES_PER_TOKEN} a token); is reward.judge.url an "
                f"OpenAI-compatible server? (raise reward.judge.max_tokens for longer verdicts)")

    def _model(self) -> str:
        if self.model is None:
            listing = self._post("/models", None, "listing the served models")
            try:
                self.model = listing["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise JudgeUnavailable(f"reward.judge ({self.url}) GET /models: no model listed; set "
                                       f"reward.judge.model") from None
        return self.model

    def check_reachable(self) -> None:
        """Ask the server for its models: one line when it cannot be reached (a server that does
        not list models is fine while ``model`` is set)."""
        try:
            self._post("/models", None, "checking the judge at start")
        except JudgeUnavailable as exc:
            if self.model is None or "not reachable" in str(exc):
                raise

    def verdict(self, example, response: str) -> str:
        """The judge's greedy answer about one completion."""
        record = f"record {example.where or repr(example.prompt)}"
        text = self.settings.template.format(prompt=example.prompt, response=response,
                                             ground_truth="" if example.answer is None else example.answer)
        payload = {"model": self._model(), "max_tokens": self.settings.max_tokens, "temperature": 0.0, "n": 1}
        if self.settings.api == "chat":
            answer = self._post("/chat/completions", {**payload, "messages": [{"role": "user", "content": text}]},
                                record)
        else:
            answer = self._post("/completions", {**payload, "prompt": text}, record)
        try:
            choice = answer["choices"][0]
            content = choice["message"]["content"] if self.settings.api == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise JudgeUnavailable(f"reward.judge ({self.url}): an answer without a choice's text "
                                   f"({record}): {json.dumps(answer)[:200]}") from None
        return content or ""

    def score_all(self, examples, texts: list[str], responses, group: int = 1, answers=None):
        """Scores of ``texts`` (row i answers ``examples[i // group]``) and ``judge_unparsable``."""
        # On the pool's daemon threads, the main thread waiting where a stop reaches it (network_waits.py).
        what = f"reward.judge ({self.url})"
        wait_or_stop([self._pool.submit(self._model)], what)
        verdicts = wait_or_stop([self._pool.submit(self.verdict, examples[i // group], texts[i])
                                 for i in range(len(texts))], what)
        scores = [parse_verdict(v, self.settings) for v in verdicts]
        for i, (score, verdict) in enumerate(zip(scores, verdicts)):
            if score is None and self.settings.on_unparsable == "error":
                example = examples[i // group]
                raise RewardError(f"reward.judge: the verdict {verdict[:120]!r} does not parse as "
                                  f"parse={self.settings.parse} (record {example.where or repr(example.prompt)}); "
                                  f"fix reward.judge.template/pattern or set reward.judge.on_unparsable=zero|skip")
        rewards = []
        for start in range(0, len(scores), group):
            members = scores[start:start + group]
            parsed = [s for s in members if s is not None]
            fill = sum(parsed) / len(parsed) if parsed and self.settings.on_unparsable == "skip" else 0.0
            rewards += [fill if s is None else s for s in members]
        return rewards, {"judge_unparsable": [float(s is None) for s in scores]}

    def close(self) -> None:
        self._pool.close()
        if self.server is not None:
            self.server.stop()


def refuse_several_nodes(nodes: int) -> None:
    """``checkpoint``'s server runs on rank 0's node, listening on 127.0.0.1 there: the ranks of
    other nodes would ask their own 127.0.0.1 (nothing there, or another server). With several
    nodes, one line at start pointing to ``url``, before any server starts."""
    if nodes > 1:
        raise ConfigError(f"reward.judge.checkpoint: the judge's vLLM server runs on rank 0's node only (on "
                          f"127.0.0.1), which the ranks of the other {nodes - 1} of this run's {nodes} nodes cannot "
                          f"reach; serve the judge where every node reaches it (python -m "
                          f"vllm.entrypoints.openai.api_server --model DIR --host 0.0.0.0 --port PORT) and give "
                          f"reward.judge.url=http://HOST:PORT/v1 instead of reward.judge.checkpoint")


def build_judge(section, backend=None, log_dir: str | None = None) -> Judge:
    """The judge ``reward.judge`` describes; with ``checkpoint``, rank 0 starts its server first
    and every rank gets the URL (judge_server.py)."""
    from polyfsdp.backends.distributed import broadcast_object, current_rank, current_world_size
    from polyfsdp.backends.topology import node_count

    settings = JudgeSettings.from_section(section)
    if settings.url is not None:
        judge = Judge(settings, settings.url)
        judge.check_reachable()  # before any training: an unreachable judge is found now, not at the first rollout
        return judge
    from .judge_server import JudgeServer, check_checkpoint

    from ..rank_errors import on_every_rank

    check_checkpoint(settings.checkpoint)
    refuse_several_nodes(node_count())
    server = JudgeServer(settings.checkpoint, backend, settings.gpu_memory_utilization, settings.start_timeout_s,
                         log_dir) if current_rank() == 0 else None
    # A server that fails to start stops every rank with its line (none waits for a URL forever).
    url = on_every_rank(lambda: server.start() if server is not None else None)
    if current_world_size() > 1:
        url = broadcast_object(url)
    return Judge(settings, url, server)

