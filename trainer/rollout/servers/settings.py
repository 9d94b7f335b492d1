"""``rollout.vllm`` and ``rollout.server``: vLLM's own settings (the colocated engine's and the
servers') and where the rollout servers of ``rollout.engine=vllm_server`` run and how polyfsdp
reaches them. A leaf without torch: the job's configuration declares them as its sections."""
from __future__ import annotations

from dataclasses import dataclass

from polyfsdp.engines.config import setting

from ...errors import ConfigError
from ...config.bounds import convert


@dataclass
class VllmSettings:
    """``rollout.vllm``: passed to vLLM (null: its default, or the backend's where noted)."""

    gpu_memory_utilization: float = setting(0.5, doc="share of device memory vLLM takes (GPU/NPU), next to "
                                                     "training")
    kv_cache_mb: int | None = setting(None, doc="KV cache size; null: vLLM's choice, 512 on CPU")
    max_model_len: int | None = setting(None, doc="null: the model's max_position_embeddings")
    max_num_seqs: int | None = setting(None, doc="null: vLLM's default")
    sleep_level: int | str = setting("auto", doc="between rollouts; auto: 2 (1 with LoRA, 1 on NPUs; CPU: no "
                                                 "sleep); 0: never")

    def __post_init__(self) -> None:
        if isinstance(self.gpu_memory_utilization, bool) or not (
                isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ConfigError(f"rollout.vllm.gpu_memory_utilization: expected a number in (0, 1], "
                              f"got {self.gpu_memory_utilization!r}")
        for key in ("kv_cache_mb", "max_model_len", "max_num_seqs"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"rollout.vllm.{key}: expected null or an integer >= 1, got {value!r}")
        if self.sleep_level not in ("auto", 0, 1, 2):
            raise ConfigError(f"rollout.vllm.sleep_level: expected auto, 0, 1 or 2, got {self.sleep_level!r}")


@dataclass
class ServerSettings:
    """``rollout.server``: the rollout servers of ``rollout.engine=vllm_server``."""

    count: int = setting(1, doc="servers polyfsdp starts, each under a keeper that ends it with the trainer")
    urls: list[str] | None = setting(None, doc="or servers started elsewhere, e.g. [http://10.0.0.2:8000]: then "
                                               "count is unused")
    host: str = setting("127.0.0.1", doc="address the started servers listen on")
    port: int = setting(0, doc="first started server's port (the i-th: port + i); 0: free ports")
    tensor_parallel_size: int = setting(1, doc="devices per started server")
    devices: list[str] | None = setting(None, doc="per started server its devices: GPU/NPU ids (\"2,3\") or CPU "
                                                  "cores (\"0-3\")")
    extra_args: list[str] = setting([], doc="more vLLM server arguments, e.g. [--max-num-batched-tokens, "
                                            "\"8192\"]")
    transfer_address: str | None = setting(None, doc="how servers reach trainer rank 0 for weights; null: host, "
                                                     "or this node's name")
    start_timeout_s: float = setting(900.0, doc="a started server must answer /health within this")
    request_timeout_s: float = setting(600.0, doc="one HTTP request's overall deadline (a completion, one weight "
                                                  "bucket)")
    max_concurrent_requests: int = setting(64, doc="completions in flight per trainer rank, over all servers")

    def __post_init__(self) -> None:
        for key in ("urls", "devices", "extra_args"):
            value = getattr(self, key)
            if value is not None:
                if isinstance(value, str) or not all(isinstance(v, (str, int)) for v in value):
                    raise ConfigError(f"rollout.server.{key}: expected a list of strings, got {value!r}")
                setattr(self, key, [str(v) for v in value])
        self._check()

    @classmethod
    def from_section(cls, data) -> "ServerSettings":
        """Checked settings from a ``rollout.server`` mapping; ConfigError naming a bad key."""
        return convert(cls, dict(data or {}), "rollout.server")

    def _check(self) -> None:
        for key, low in (("count", 1), ("tensor_parallel_size", 1), ("max_concurrent_requests", 1), ("port", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"rollout.server.{key}: expected an integer >= {low}, got {value!r}")
        if self.port and self.port + self.count - 1 > 65535:
            raise ConfigError(f"rollout.server.port: {self.port} + {self.count} servers passes 65535")
        for key in ("start_timeout_s", "request_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"rollout.server.{key}: expected a number > 0, got {value!r}")
        if self.urls is not None:
            if not self.urls:
                raise ConfigError("rollout.server.urls: an empty list; give the servers' addresses "
                                  "(http://host:port) or null to start rollout.server.count of them")
            for url in self.urls:
                if not url.startswith(("http://", "https://")) or "://" == url[-3:]:
                    raise ConfigError(f"rollout.server.urls: {url!r} is not an address like http://host:8000")
        if self.devices is not None and self.urls is None and len(self.devices) != self.count:
            raise ConfigError(f"rollout.server.devices: {len(self.devices)} entries for rollout.server.count="
                              f"{self.count} servers; give one per server (e.g. [\"0\", \"1\"])")

    @property
    def started_here(self) -> bool:
        """Whether polyfsdp starts the servers (else it connects to ``urls``)."""
        return self.urls is None

    def server_count(self) -> int:
        return self.count if self.urls is None else len(self.urls)
