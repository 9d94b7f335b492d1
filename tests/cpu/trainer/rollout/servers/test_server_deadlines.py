"""Every request to a rollout server is bounded (trainer/rollout/servers/http.py, through
trainer/deadline_http.py), and a stop is not held up by one, without vLLM: a 127.0.0.1 server
that drips its answer (one byte every 0.5 s, for 60 s) is failed at the request's overall
deadline in one line naming the server and the route; an answer over what the request can produce
is refused without being read whole; the health probe has a deadline of its own; a SIGTERM while
a started server loads, or while the engine waits for rows from a dripping server, stops the wait;
and ``polyfsdp-train`` ends with 143 (SIGTERM) or 130 (Ctrl-C) and one stop line while its only
server drips (a SIGTERM during a step's rollout saves the step boundary's checkpoint first).

Requests that would outlive their bound run on a thread joined for ``JOIN_S``, far below the
drip's 60 s: a per-read timeout alone (each read is quick) fails the test instead of passing late.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from polyfsdp.backends.registry import get_backend
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.network_waits import StoppedWhileWaiting, unwatch_stop, watch_stop
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.servers.engine import ServerRolloutEngine
from polyfsdp.trainer.rollout.servers.http import Fanout, ServerError, ServerHttp
from polyfsdp.trainer.rollout.servers.launch import ServerLaunch, ServerProcess, free_ports
from tests.helpers.child_exit import finish_within
from tests.helpers.ctrl_c import as_at_a_terminal
from tests.helpers.misbehaving_http import MisbehavingJudge

JOIN_S = 30  # far above a 2 s deadline (and the health probe's 5 s), far below the drip's 60 s
DRIP = {"interval_s": 0.5, "count": 120}


def _server_url(server: MisbehavingJudge) -> str:
    return server.url.removesuffix("/v1")  # the helper speaks for any path; a rollout server's base URL


def _engine(url: str, request_timeout_s: float) -> ServerRolloutEngine:
    """A ServerRolloutEngine connected to ``url`` (a server started elsewhere), as _start does
    before the first weight push."""
    section = RolloutSection(engine="vllm_server", server={"urls": [url], "request_timeout_s": request_timeout_s})
    engine = ServerRolloutEngine(section, get_backend())
    engine._connect([(url, None)])
    return engine


def _bounded(work):
    """``work()``'s outcome ("value" or "error"), on a daemon thread joined for JOIN_S."""
    outcome = {}

    def run():
        try:
            outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive(), f"still waiting {JOIN_S} s later: only a per-read timeout applied"
    return outcome


def _params(max_new_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_new_tokens, temperature=1.0, return_log_probs=True)


@pytest.mark.parametrize("mode", ["drip-headers", "drip-body"])
def test_a_server_dripping_its_answer_is_failed_at_the_overall_deadline_in_one_line(mode):
    server = MisbehavingJudge(mode, **DRIP)
    url = _server_url(server)
    engine = _engine(url, request_timeout_s=2)
    try:
        outcome = _bounded(lambda: engine.generate([[1, 2, 3], [4, 5]], _params(), seeds=[0, 1]))
    finally:
        engine.close()
        server.close()
    assert isinstance(outcome.get("error"), ServerError), outcome
    assert str(outcome["error"]) == (f"rollout server 0 ({url}) POST /v1/completions: no answer within 2 s "
                                     f"(rollout.server.request_timeout_s)")


@pytest.mark.parametrize("mode", ["flood", "flood-length"])
def test_a_completion_over_what_its_prompt_and_max_tokens_can_take_is_refused_without_reading_it(mode):
    """50 MB (streamed, or announced by its Content-Length) for a 3-token prompt and 16 new tokens:
    the engine reads at most 64 KiB + 1 KiB a token and closes; the server sent little of it."""
    server = MisbehavingJudge(mode, flood_bytes=50 << 20)
    url = _server_url(server)
    engine = _engine(url, request_timeout_s=60)
    try:
        outcome = _bounded(lambda: engine.generate([[1, 2, 3]], _params(16), seeds=[0]))
    finally:
        engine.close()
        server.close()
    assert isinstance(outcome.get("error"), ServerError), outcome
    assert str(outcome["error"]) == (
        f"rollout server 0 ({url}) POST /v1/completions: the answer is over 84992 bytes, the most read for a "
        f"3-token prompt and max_tokens=16 (65536 + 1024 a token); is it a vLLM OpenAI server started as "
        f"docs/rollouts-and-servers.md says?")
    # What the sockets' buffers held once the engine stopped reading (a few MB on loopback), not the 50 MB.
    assert server.sent < 20 << 20, server.sent


def test_a_control_routes_answer_is_capped_at_a_few_mib():
    """A weight-transfer route (Fanout, on its daemon pool) answered with 50 MB: refused at 4 MiB."""
    server = MisbehavingJudge("flood", flood_bytes=50 << 20)
    url = _server_url(server)
    fanout = Fanout([url], 60.0)
    try:
        outcome = _bounded(lambda: fanout.call("/pause?mode=keep"))
    finally:
        fanout.close()
        server.close()
    assert isinstance(outcome.get("error"), ServerError), outcome
    assert str(outcome["error"]) == (
        f"rollout server 0 ({url}) POST /pause: the answer is over 4194304 bytes, the most read for a control "
        f"route's answer (rollout servers answer these in a few KiB); is it a vLLM OpenAI server started as "
        f"docs/rollouts-and-servers.md says?")
    assert server.sent < 20 << 20, server.sent


def test_a_health_probe_that_drips_is_not_healthy_within_its_own_deadline():
    server = MisbehavingJudge("drip-headers", on_get=True, **DRIP)
    try:
        outcome = _bounded(lambda: ServerHttp(_server_url(server), "rollout server 0", 600).healthy())
    finally:
        server.close()
    assert outcome == {"value": False}, outcome


@pytest.fixture
def sigterm_seen():
    """The job's stop flag, as after a SIGTERM (trainer/run/stop.py's StopRequest sets it)."""
    stop = types.SimpleNamespace(requested=True)
    watch_stop(stop)
    yield stop
    unwatch_stop(stop)


def test_a_sigterm_while_a_started_server_loads_stops_the_wait(sigterm_seen, tmp_path):
    """Its /health not answering yet (nothing listens): the wait for the start (600 s here) ends."""
    process = ServerProcess(0, ServerLaunch(str(tmp_path), free_ports(1)[0]), {}, str(tmp_path / "server_0.log"), 60)
    outcome = _bounded(lambda: process.wait_ready(time.monotonic() + 600))
    assert isinstance(outcome.get("error"), StoppedWhileWaiting), outcome
    assert str(outcome["error"]) == f"stopped by SIGTERM while waiting for rollout server 0 ({process.url}) to start"


def test_a_sigterm_while_the_engine_waits_for_a_dripping_server_stops_the_wait(sigterm_seen):
    """On the main thread (where a SIGTERM is seen), with request_timeout_s=600: the rows are left to
    the pool's daemon threads. Run here, not on a joined thread: a hang shows as the test's hang."""
    server = MisbehavingJudge("drip-body", **DRIP)
    url = _server_url(server)
    engine = _engine(url, request_timeout_s=600)
    try:
        with pytest.raises(StoppedWhileWaiting) as stopped:
            engine.generate([[1, 2, 3]], _params(), seeds=[0])
    finally:
        engine.close()
        server.close()
    assert str(stopped.value) == f"stopped by SIGTERM while waiting for rollout server 0 ({url})"


# polyfsdp-train with rollout.engine=vllm_server and rollout.server.urls=[the dripping server]: the
# weight transfer needs a vLLM server's workers, so the child connects without it (its _start connects
# only; every version it pushed is the one served) and samples from the server as a run does.
CHILD = textwrap.dedent("""\
    import sys
    from polyfsdp.trainer.rollout.servers.engine import ServerRolloutEngine

    ServerRolloutEngine._start = lambda self, policy: self._connect([(u, None) for u in self.settings.urls])
    ServerRolloutEngine._confirm_version = lambda self: None
    from polyfsdp.trainer.train import main

    sys.exit(main(sys.argv[1:]))
    """)
JOB = ["trainer.sft_steps=0", "trainer.rl_steps=2", "trainer.prompts_per_step=2", "algo.actor.group_size=2",
       "trainer.progress=off", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0",
       "data.eval_size=2", "rollout.engine=vllm_server", "rollout.check_sync=false"]
CHILD_TIMEOUT_S = 60  # far below the drip's 60 s plus the run's start


@pytest.mark.parametrize("signum,code,where", [(signal.SIGTERM, 143, "step"), (signal.SIGTERM, 143, "initial"),
                                                (signal.SIGINT, 130, "initial")])
def test_a_stop_ends_a_run_whose_rollout_server_drips(tmp_path, signum, code, where):
    """``where``: the wait the stop lands in, the first RL step's rollout (eval.initial=false) or the
    initial evaluation's, which no step guards."""
    server = MisbehavingJudge("drip-body", interval_s=0.5, count=300)
    url = _server_url(server)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *JOB, f"rollout.server.urls=[{url}]",
                             "rollout.server.request_timeout_s=600", f"eval.initial={where == 'initial'}".lower(),
                             f"trainer.output_dir={tmp_path / 'run'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "POLYFSDP_BACKEND": "cpu"}, preexec_fn=as_at_a_terminal)
    try:
        try:
            assert server.post_seen.wait(240), "the run never asked the server"
        finally:
            if proc.poll() is None:
                proc.send_signal(signum)
        status, lines = finish_within(proc, CHILD_TIMEOUT_S)
    finally:
        server.close()
    assert status == code and len(lines) == 1, (status, lines)
    run = tmp_path / "run"
    if where == "step":
        # One rank, a step with no update yet: abandoned at the wait, as at its cancellation points,
        # and the boundary's checkpoint saved.
        assert lines[0].startswith(f"polyfsdp-train: stopped by SIGTERM after rl step 0 (left for the resumed run: "
                                   f"rl step 1); checkpoint saved: {run}/checkpoints/rl/step_000000; continue with: "
                                   f"polyfsdp-train "), lines
    else:
        how = f"stopped by SIGTERM while waiting for rollout server 0 ({url})" if signum == signal.SIGTERM \
            else "interrupted"
        assert lines[0].startswith(f"polyfsdp-train: {how} before the first step; no checkpoint yet; continue "
                                   f"with: polyfsdp-train "), lines
