"""A real vLLM OpenAI server as a subprocess for tests (``running_server``), and a JSON POST to it.

Starting one takes ~30 s on a CPU, so tests share one per module (a module-scoped fixture around
``running_server``). The process group is killed on the way out, also when the test failed.
"""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(url: str, payload: dict, timeout_s: float = 120.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:  # the server's reason, not just the status
        raise RuntimeError(f"POST {url}: HTTP {err.code}: {err.read().decode(errors='replace')}") from None


def get_json(url: str, timeout_s: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_server(model_dir: str, log_path, *, weight_transfer: str | None = "polyfsdp_cpu",
                   start_timeout_s: float = 240.0):
    """Yield the base URL of a dev-mode vLLM server of ``model_dir`` (fp32, eager, no tokenizer), with
    ``weight_transfer`` as its weight-transfer backend (None: none). Its output goes to ``log_path``."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05",
               "--skip-tokenizer-init", "--port", str(port), "--seed", "0"]
    if weight_transfer is not None:
        command += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        # A session of its own, so the kill below reaches the engine core and workers too.
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = open(log_path, errors="replace").read()[-3000:]
                raise RuntimeError(f"vLLM server did not come up (exit {server.poll()}); log tail:\n{tail}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=20)
        # Whatever of the group outlived the TERM (engine core, workers) goes now.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
