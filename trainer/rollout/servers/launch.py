"""Starting vLLM OpenAI servers for rollouts: the command line (one place, used both for the
servers polyfsdp starts and, through ``python -m polyfsdp.trainer.rollout.servers.launch``, for
the ones a user starts on another node), and :class:`ServerProcess`, a started server owned by
the trainer (through the keeper in supervisor.py, so no server outlives it).

Every flag is there for a reason: token ids in and out (no tokenizer on the server), the
log-probs of the distribution each token was drawn from (``processed_logprobs``, what the
colocated engine reports), our sampling parameters only (``generation_config vllm``), eager
execution (nothing to recompile after a weight update), the weight-transfer routes
(``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config``). A vision-language model's server
loads the processor of its directory (vLLM's multimodal processor needs its tokenizer) and opens
the token-in route that takes images (``--enable-scale-out``: completions.py), for images only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ...network_waits import StoppedWhileWaiting, stop_requested
from . import gloo_wire
from .http import ServerError, ServerHttp
from .server_log import failure_line
from ..vllm_adapter import unchunked_prefill

SERVED_MODEL_NAME = "polyfsdp-policy"


@dataclass
class ServerLaunch:
    """What one server runs: ``model_dir`` at ``dtype`` on ``host:port``."""

    model_dir: str
    port: int
    host: str = "127.0.0.1"
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    weight_transfer: str | None = gloo_wire.BACKEND   # None: a server without the weight-transfer routes
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    extra_args: list[str] = field(default_factory=list)
    served_model_name: str = SERVED_MODEL_NAME
    text: bool = False  # True: the server loads the model's tokenizer and takes text (a reward judge's)
    chunked_prefill: bool = True  # False: every prompt prefilled whole (the backend's vllm_chunked_prefill)
    images: int = 0  # images per prompt a vision-language model's server takes (0: a text model)

    def command(self, python: str = sys.executable) -> list[str]:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype, "--tensor-parallel-size", str(self.tensor_parallel_size), "--seed", "0",
               "--enforce-eager", *([] if self.text or self.images else ["--skip-tokenizer-init"]),
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
        if self.images:
            cmd += ["--enable-scale-out", "--limit-mm-per-prompt", json.dumps({"image": self.images, "video": 0})]
        if self.weight_transfer is not None:
            cmd += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        for flag, value in (("--gpu-memory-utilization", self.gpu_memory_utilization),
                            ("--kv-cache-memory-bytes", self.kv_cache_bytes),
                            ("--max-model-len", self.max_model_len), ("--max-num-seqs", self.max_num_seqs)):
            if value is not None:
                cmd += [flag, str(value)]
        if not self.chunked_prefill:
            budget = unchunked_prefill(self.max_model_len or model_positions(self.model_dir))
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget["max_num_batched_tokens"])]
        return cmd + list(self.extra_args)


def _model_config(model_dir: str) -> dict:
    try:
        with open(os.path.join(model_dir, "config.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def model_positions(model_dir: str) -> int | None:
    """The longest sequence the checkpoint in ``model_dir`` holds (its config's, or its text config's)."""
    config = _model_config(model_dir)
    return config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")


def holds_vision_model(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a vision-language model (its config has a vision tower's)."""
    return "vision_config" in _model_config(model_dir)


def server_environment(devices: str | None, devices_variable: str | None) -> dict[str, str]:
    """The variables a server needs on top of ours: the weight-transfer routes, its devices."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if devices is not None and devices_variable is not None:
        env[devices_variable] = devices
    return env


def host_memory_share(model_dir: str, kv_cache_mb: int, host_bytes: int | None) -> float:
    """``--gpu-memory-utilization`` where device memory is host memory (CPU): vLLM reserves that
    share of the host at start-up and refuses to start when it is not free, so ask for what the
    server needs: its weights (twice: loading), its KV cache and 1 GiB of working memory."""
    weights = sum(os.path.getsize(os.path.join(model_dir, name)) for name in os.listdir(model_dir)
                  if name.endswith((".safetensors", ".bin", ".pt")))
    need = 2 * weights + (kv_cache_mb << 20) + (1 << 30)
    total = host_bytes or need * 10
    return round(min(0.9, max(0.01, need / total)), 4)


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports free on this host now (the OS's choice)."""
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ServerProcess:
    """One server polyfsdp started (``index`` names it in messages); its output goes to ``log_path``."""

    def __init__(self, index: int, launch: ServerLaunch, env: dict[str, str], log_path: str,
                 request_timeout_s: float, cores: set[int] | None = None, name: str | None = None,
                 start_timeout_key: str = "rollout.server.start_timeout_s") -> None:
        self.index, self.launch, self.env, self.log_path = index, launch, env, log_path
        # What messages call it (another owner, such as reward.judge, names its own).
        self.name, self.start_timeout_key = name or f"rollout server {index}", start_timeout_key
        self.cores = cores  # the host cores its processes run on (the keeper pins them); None: ours
        host = "127.0.0.1" if launch.host in ("0.0.0.0", "::") else launch.host
        self.url = f"http://{host}:{launch.port}"
        self.http = ServerHttp(self.url, self.name, request_timeout_s, explain=self.explain_failure)
        self.proc: subprocess.Popen | None = None

    def explain_failure(self, what: str) -> str:
        """``what`` (a failure of this server, one line) with the server's exit code if it is gone,
        its log and the root cause found there."""
        return failure_line(what, self.log_path, self.proc.poll() if self.proc is not None else None)

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        pin = ["--cores", ",".join(map(str, sorted(self.cores)))] if self.cores else []
        keeper = [sys.executable, "-m", "polyfsdp.trainer.rollout.servers.supervisor", str(os.getpid()), *pin, "--"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(keeper + self.launch.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, **self.env})

    def wait_ready(self, deadline: float) -> None:
        """Return once ``/health`` answers; ServerError when the server exits or ``deadline`` passes;
        StoppedWhileWaiting when the job gets a SIGTERM meanwhile (trainer/network_waits.py: a start
        may take ``start_timeout_s``, 900 s by default, and each probe ``HEALTH_TIMEOUT_S``)."""
        while True:
            code = self.proc.poll() if self.proc is not None else None
            if code is not None:
                raise ServerError(failure_line(f"{self.name} ({self.url}) did not start", self.log_path, code))
            if self.http.healthy():
                return
            if stop_requested():
                raise StoppedWhileWaiting(f"{self.name} ({self.url}) to start")
            if time.monotonic() > deadline:
                raise ServerError(self.explain_failure(f"{self.name} ({self.url}) did not answer /health within "
                                                       f"{self.start_timeout_key}"))
            time.sleep(1.0)

    def died(self) -> str | None:
        """Why the server is gone (one line), or None while it runs."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            return None
        return failure_line(f"{self.name} ({self.url}) is no longer running", self.log_path, code)

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the server and everything it started (the keeper ends its process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the keeper's parent-death watch is gone with it, but its group got SIGTERM
            self.proc.wait()


def model_dtype(model_dir: str) -> tuple[str, str]:
    """The dtype a server of ``model_dir`` runs at by default, and where it comes from: its config's
    (``dtype``, or ``torch_dtype`` as transformers before 4.56 wrote it; a vision-language model's
    text config's), else float32, what transformers loads a config naming none at and the trainer's
    default ``engine.param_dtype``. Never vLLM's ``auto``: that serves a float32 checkpoint in
    float16 or bfloat16 on a GPU, whose log-probs then miss ``rollout.check_sync_tol``."""
    config = _model_config(model_dir)
    for where in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(where.get(key), str):
                found = where[key].removeprefix("torch.")
                text = "text_config." if where is not config else ""
                return found, f"{model_dir}/config.json {text}{key}"
    return "float32", f"{model_dir}/config.json names no dtype: float32, the trainer's default engine.param_dtype"


def launch_parser():
    """The launcher's command line (main); every option's help says its default."""
    import argparse

    from polyfsdp.trainer.rollout.vllm import HOST_KV_CACHE_MB

    parser = argparse.ArgumentParser(prog="python -m polyfsdp.trainer.rollout.servers.launch",
                                     description=main.__doc__)
    parser.add_argument("--model", required=True, help="an HF checkpoint directory of the policy's architecture")
    parser.add_argument("--port", type=int, default=8000, help="the HTTP port (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0",
                        help="the address to listen on (default: %(default)s, every interface: the trainer is on "
                             "another node)")
    parser.add_argument("--dtype", default="auto",
                        help="the weights' dtype; it must be the trainer's engine.param_dtype, or rollout.check_sync "
                             "fails (default: auto, the model directory's config.json dtype or torch_dtype, float32 "
                             "where it names none; never vLLM's own auto)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="devices the server shards the model over (default: %(default)s)")
    parser.add_argument("--weight-transfer", default=None,
                        help="the trainer's device backend's (backends/: server_weight_transfer); default: this "
                             "machine's")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's share of device memory (default: vLLM's; on CPU what the server needs)")
    parser.add_argument("--kv-cache-mb", type=int, default=None,
                        help=f"KV cache size in MiB (default: what vLLM's memory share leaves on a device; on CPU "
                             f"{HOST_KV_CACHE_MB})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Start one rollout server in the foreground, with the flags polyfsdp needs: for servers on
    another node (``rollout.server.urls``). Arguments after ``--`` go to vLLM as they are."""
    args, extra = launch_parser().parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    from polyfsdp.backends import get_backend
    from polyfsdp.trainer.rollout.vllm import kv_cache_mb

    backend = get_backend("auto")
    kv_mb = kv_cache_mb(args.kv_cache_mb, backend)
    model_dir = args.model
    share = args.gpu_memory_utilization
    if share is None and backend.memory_is_host:
        share = host_memory_share(model_dir, kv_mb, backend.memory_capacity_bytes())
    from polyfsdp.trainer.rollout.servers.vision_serving import MAX_IMAGES_PER_PROMPT

    dtype, source = (args.dtype, "--dtype") if args.dtype != "auto" else model_dtype(model_dir)
    print(f"dtype {dtype} ({source})", flush=True)
    launch = ServerLaunch(model_dir, args.port, args.host, dtype, args.tensor_parallel_size,
                          args.weight_transfer or backend.server_weight_transfer, gpu_memory_utilization=share,
                          kv_cache_bytes=kv_mb << 20 if kv_mb else None, extra_args=extra,
                          chunked_prefill=backend.vllm_chunked_prefill,
                          images=MAX_IMAGES_PER_PROMPT if holds_vision_model(model_dir) else 0)
    env = {**os.environ, **server_environment(None, None)}
    cmd = launch.command()
    print(" ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
