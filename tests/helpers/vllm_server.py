"""A real vLLM OpenAI server for tests (``running_server``), started the way polyfsdp starts
its rollout servers (trainer/rollout/servers/launch.py, under the keeper that ends its process
group), plus JSON requests to it.

Starting one takes ~30 s on a CPU, so tests share one per module (a module-scoped fixture around
``running_server``); it is stopped on the way out, also when the test failed.
"""
import contextlib
import time

from polyfsdp.trainer.rollout.servers.launch import free_ports
from polyfsdp.trainer.rollout.servers.http import ServerHttp
from polyfsdp.trainer.rollout.servers.launch import ServerLaunch, ServerProcess, server_environment


def free_port() -> int:
    return free_ports(1)[0]


def post_json(url: str, payload: dict, timeout_s: float = 120.0) -> dict:
    return ServerHttp(url, "test server", timeout_s).request("", payload)


def get_json(url: str, timeout_s: float = 30.0) -> dict:
    return ServerHttp(url, "test server", timeout_s).request("", method="GET")


@contextlib.contextmanager
def running_server(model_dir: str, log_path, *, weight_transfer: str | None = "polyfsdp_cpu",
                   start_timeout_s: float = 240.0):
    """Yield the base URL of a vLLM server of ``model_dir`` (fp32, eager, no tokenizer, served
    under its path as name), with ``weight_transfer`` as its weight-transfer backend (None: none).
    Its output goes to ``log_path``."""
    launch = ServerLaunch(str(model_dir), free_port(), weight_transfer=weight_transfer, gpu_memory_utilization=0.05,
                          served_model_name=str(model_dir))
    server = ServerProcess(0, launch, server_environment(None, None), str(log_path), 120.0)
    server.start()
    try:
        server.wait_ready(time.monotonic() + start_timeout_s)
        yield server.url
    finally:
        server.stop()
