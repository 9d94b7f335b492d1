"""A rollout server's failure names its root cause (trainer/rollout/servers/server_log.py), without
vLLM: a stand-in server, started by the engine through the keeper as a vLLM server is, logs what a
vLLM server logs when its engine core fails (a traceback ending in the cause, then vLLM's pointer
to it) and answers HTTP 500; the engine's failure line names the request, the server's log and the
cause found there. A server killed mid-run (connection refused) names the same; and check_sync's
failure names a dtype difference between the server and the policy as its likely cause."""
import os
import signal
import sys
import textwrap
import time

import pytest

from polyfsdp.backends.registry import get_backend
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.servers.engine import ServerRolloutEngine, dtype_difference, server_dtype
from polyfsdp.trainer.rollout.servers.http import ServerError, ServerHttp
from polyfsdp.trainer.rollout.servers.launch import ServerLaunch
from polyfsdp.trainer.rollout.servers.server_log import log_root_cause
from polyfsdp.trainer.rollout.vllm import refuse_probe_difference

CAUSE = "ValueError: Unsupported CPU attention configuration: head_dim=8"

# What vLLM 0.x on CPU logs and answers when its engine core fails on the first request: the
# engine core's traceback ending in the cause, then the API server's EngineDeadError pointing at it.
FAKE_SERVER = textwrap.dedent("""\
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer(200, {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/completions":
                return self._answer(200, {})
            print("(EngineCore_DP0 pid=1) ERROR [core.py:710] EngineCore encountered a fatal error.", flush=True)
            print("(EngineCore_DP0 pid=1) ERROR [core.py:710] Traceback (most recent call last):", flush=True)
            print('(EngineCore_DP0 pid=1) ERROR [core.py:710]   File "cpu_attn.py", line 88, in build', flush=True)
            print("(EngineCore_DP0 pid=1) ERROR [core.py:710] CAUSE", flush=True)
            print("(APIServer pid=2) ERROR [async_llm.py:480] AsyncLLM output_handler failed.", flush=True)
            print("(APIServer pid=2) ERROR [async_llm.py:480] vllm.v1.engine.exceptions.EngineDeadError: "
                  "EngineCore encountered an issue. See stack trace (above) for the root cause.", flush=True)
            self._answer(500, {"error": {"message": "EngineCore encountered an issue. See stack trace (above) "
                                                    "for the root cause."}})

        def log_message(self, *args):
            print("INFO:", args[0] % args[1:], flush=True)

    print("INFO: server pid", os.getpid(), flush=True)
    server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.timeout = 1.0
    deadline = time.monotonic() + 300  # bounded: never outlives a stuck test by long
    while time.monotonic() < deadline:
        server.handle_request()
    """).replace("CAUSE", CAUSE)


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A ServerRolloutEngine whose one started server is the stand-in (through the keeper, its
    output in OUTPUT_DIR/rollout_servers/server_0.log as a vLLM server's)."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    monkeypatch.setattr(ServerLaunch, "command",
                        lambda self, python=sys.executable: [python, str(script), str(self.port)])
    section = RolloutSection(engine="vllm_server", server={"start_timeout_s": 60, "request_timeout_s": 30})
    built = ServerRolloutEngine(section, get_backend(), log_dir=str(tmp_path / "rollout_servers"))
    built.model_dir = str(tmp_path / "weights")  # what _start writes; its size sizes the server's memory share
    os.makedirs(built.model_dir)
    built._launch("float32")  # rank 0's part of _start: started, /health answered, version 1 set
    built._connect([(process.url, process.log_path) for process in built.processes])
    yield built
    built.close()


def _wait_dead(pid: int) -> None:
    """Until ``pid`` is a zombie (its keeper has not reaped it yet) or gone."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs 60 s after SIGKILL")


def _params():
    return SamplingParams(4, temperature=1.0, return_log_probs=True)


def test_an_engine_core_failure_names_the_request_the_log_and_the_cause_found_in_it(engine):
    log = engine.processes[0].log_path
    with pytest.raises(ServerError) as err:
        engine.generate([[1, 2, 3]], _params(), seeds=[0])
    message = str(err.value)
    assert message.startswith(f"rollout server 0 ({engine.servers[0].url}) POST /v1/completions: HTTP 500: "
                              f"EngineCore encountered an issue"), message
    assert message.endswith(f"; server log {log}, last error: {CAUSE}"), message
    assert "\n" not in message


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads a process's state from /proc (Linux)")
def test_a_server_killed_mid_run_names_its_log_and_the_cause_found_in_it(engine):
    """The server failed a request, then was killed: the next request is refused, and its line
    names the log and the error logged before (the exit code too once the keeper has seen it)."""
    with pytest.raises(ServerError):
        engine.generate([[1, 2, 3]], _params(), seeds=[0])
    log = engine.processes[0].log_path
    with open(log) as fh:
        pid = int(next(line for line in fh if line.startswith("INFO: server pid")).split()[-1])
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)  # its listening socket closed: a connection is refused, not accepted and then reset
    with pytest.raises(ServerError) as err:  # straight to the server: generate() may see the exit first
        engine.servers[0].request("/v1/completions", {"prompt": [1]})
    message = str(err.value)
    assert message.startswith(f"rollout server 0 ({engine.servers[0].url}) POST /v1/completions: not reachable ("), \
        message
    assert "Connection refused" in message and message.endswith(f"server log {log}, last error: {CAUSE}"), message
    engine.processes[0].proc.wait(timeout=60)  # the keeper ends with its server
    with pytest.raises(ServerError) as err:
        engine.generate([[1, 2, 3]], _params(), seeds=[0])
    assert str(err.value) == (f"rollout server 0 ({engine.servers[0].url}) is no longer running; the server exited with code "
                              f"{engine.processes[0].proc.returncode}; server log {log}, last error: {CAUSE}")


def test_the_root_cause_is_the_last_error_that_is_not_a_pointer_to_another(tmp_path):
    log = tmp_path / "server_0.log"
    log.write_text(textwrap.dedent("""\
        ERROR ValueError: an earlier request's bad sampling parameters
        INFO: 127.0.0.1 "POST /v1/completions HTTP/1.1" 400
        WARNING Found ulimit of 20000 ... `OSError: [Errno 24] Too many open files`.
        (EngineCore_DP0 pid=1) ERROR Traceback (most recent call last):
        (EngineCore_DP0 pid=1) ERROR RuntimeError: worker 0 ran out of memory
        (APIServer pid=2) ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
        INFO: 127.0.0.1 "POST /v1/completions HTTP/1.1" 500
        """))
    assert log_root_cause(str(log)) == "last error: RuntimeError: worker 0 ran out of memory"
    assert log_root_cause(str(tmp_path / "missing.log")) == "no log (No such file or directory)"


def test_a_server_on_another_node_reports_its_dtype_and_check_sync_names_a_difference():
    """The failure line of the issue (the launcher's bfloat16 server, the fp32 CPU trainer): the dtype
    difference is named as the likely cause, with the launcher's flag that fixes it."""
    answers = iter([{"vllm_config": "model='/m', speculative_config=None, kv_cache_dtype=auto, "
                                    "dtype=torch.bfloat16, max_seq_len=64"},
                    {"vllm_config": {"model_config": {"dtype": "torch.float16"}}}, {"detail": "Not Found"}])

    class Server(ServerHttp):
        def request(self, route, payload=None, method="POST", timeout_s=None):
            assert (route, method) == ("/server_info", "GET")
            answer = next(answers)
            if "detail" in answer:
                raise ServerError("rollout server 0 (http://h:1) GET /server_info: HTTP 404: Not Found")
            return answer

    server = Server("http://h:1", "rollout server 0", 1.0)
    assert [server_dtype(server), server_dtype(server), server_dtype(server)] == ["bfloat16", "float16", None]

    with pytest.raises(ServerError) as err:
        refuse_probe_difference(0.00163, 1e-3, 1, "the rollout server", ServerError,
                                dtype_difference("bfloat16", "float32"))
    assert str(err.value) == (
        "rollout.check_sync: after weight sync 1, the rollout server's log-probs of the probe differ from the "
        "policy's by 0.00163 (rollout.check_sync_tol=0.001): the server holds its weights in bfloat16 and the policy "
        "trains in float32 (engine.param_dtype), a difference that rounds every log-prob: likely the cause, rather "
        "than a missed sync; start the server with --dtype float32 (python -m polyfsdp.trainer.rollout.servers.launch "
        "... --dtype float32)")
    assert dtype_difference("float32", "float32") is None and dtype_difference(None, "float32") is None
    with pytest.raises(ServerError, match=r"\(a missed or partial sync\)"):  # same dtypes: a sync is the suspect
        refuse_probe_difference(0.00163, 1e-3, 1, "the rollout server", ServerError,
                                dtype_difference("float32", "float32"))
