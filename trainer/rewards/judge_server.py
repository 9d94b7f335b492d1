"""The vLLM OpenAI server polyfsdp starts for ``reward.judge.checkpoint`` (judge.py).

Rank 0 starts one server on 127.0.0.1 (a free port) through the rollout servers' launcher
(trainer/rollout/servers/launch.py: the keeper process, so it never outlives the trainer), with
the checkpoint's own tokenizer (the judge takes text) and no weight-transfer routes (the judge is
frozen); every rank of the node sends its requests there. On a host backend (CPU) the server asks
for the host memory it needs; on a device, ``reward.judge.gpu_memory_utilization`` of the
device it shares with the trainer. A judge on other devices or nodes is started by hand
(``python -m vllm.entrypoints.openai.api_server ...``) and given as ``reward.judge.url``.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time

from ..errors import ConfigError

logger = logging.getLogger(__name__)
JUDGE_MODEL_NAME = "polyfsdp-judge"
# The KV cache of the judge's server (MiB) where memory is the host's: a verdict is short.
HOST_KV_CACHE_MB = 256


def check_checkpoint(path: str) -> None:
    """A judge checkpoint must be a model directory with a tokenizer: one line otherwise."""
    if not os.path.isdir(path):
        raise ConfigError(f"reward.judge.checkpoint={path}: no such directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"reward.judge.checkpoint={path}: no config.json (a Hugging Face model directory)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model",
                                                                     "vocab.json", "tokenizer_config.json")):
        raise ConfigError(f"reward.judge.checkpoint={path}: no tokenizer files (the judge reads and writes text)")


class JudgeServer:
    """One vLLM server for the judge (started on rank 0 by :meth:`start`, ended by :meth:`stop`)."""

    def __init__(self, checkpoint: str, backend, gpu_memory_utilization: float, start_timeout_s: float,
                 log_dir: str | None = None) -> None:
        check_checkpoint(checkpoint)
        self.checkpoint, self.backend = checkpoint, backend
        self.gpu_memory_utilization, self.start_timeout_s = gpu_memory_utilization, start_timeout_s
        self.log_dir = log_dir
        self.process = None

    def start(self) -> str:
        """Start the server and wait for it; its OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""
        from ..rollout.servers.launch import (ServerLaunch, ServerProcess, free_ports, host_memory_share,
                                              server_environment)

        kv_mb = HOST_KV_CACHE_MB if self.backend.memory_is_host else None
        share = host_memory_share(self.checkpoint, kv_mb, self.backend.memory_capacity_bytes()) \
            if self.backend.memory_is_host else self.gpu_memory_utilization
        launch = ServerLaunch(self.checkpoint, free_ports(1)[0], dtype="auto", weight_transfer=None,
                              gpu_memory_utilization=share, kv_cache_bytes=kv_mb << 20 if kv_mb else None,
                              served_model_name=JUDGE_MODEL_NAME, text=True)
        log_dir = self.log_dir or tempfile.mkdtemp(prefix="polyfsdp-judge-logs-")
        logger.info("starting the reward.judge server on %s (log: %s)", self.checkpoint, os.path.join(log_dir, "judge.log"))
        self.process = ServerProcess(0, launch, server_environment(None, None), os.path.join(log_dir, "judge.log"),
                                     request_timeout_s=self.start_timeout_s, name="reward.judge server",
                                     start_timeout_key="reward.judge.start_timeout_s")
        self.process.start()
        self.process.wait_ready(time.monotonic() + self.start_timeout_s)
        return f"{self.process.url}/v1"

    def died(self) -> str | None:
        return self.process.died() if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
