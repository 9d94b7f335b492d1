"""``rollout.server``: where the rollout servers of ``rollout.engine=vllm_server`` run and how
polyfsdp reaches them (the vLLM settings they share with the colocated engine stay in
``rollout.vllm``)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ...errors import ConfigError


@dataclass
class ServerSettings:
    count: int = 1                        # servers polyfsdp starts (ignored with urls)
    urls: list[str] | None = None         # servers someone else started (other nodes); null: start `count`
    host: str = "127.0.0.1"               # address the started servers listen on
    port: int = 0                         # first started server's port (the i-th: port + i); 0: free ports
    tensor_parallel_size: int = 1         # devices per started server
    devices: list[str] | None = None      # per started server: its devices (GPU/NPU ids, CPU cores), e.g. ["2,3"]
    extra_args: list[str] = field(default_factory=list)  # more vLLM server arguments, as on its command line
    transfer_address: str | None = None   # how the servers reach trainer rank 0 for weights; null: host, or
    #                                       this node's name with urls
    start_timeout_s: float = 900.0        # a started server must answer /health within this
    request_timeout_s: float = 600.0      # one HTTP request (a completion, one weight bucket)
    max_concurrent_requests: int = 64     # completions in flight per trainer rank, over all servers

    @classmethod
    def from_section(cls, data) -> "ServerSettings":
        """Checked settings from the ``rollout.server`` mapping; ConfigError naming a bad key."""
        data = dict(data or {})
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                raise ConfigError(f"rollout.server.{key}: unknown key; known keys: {', '.join(known)}")
        for key in ("urls", "devices", "extra_args"):
            if data.get(key) is not None:
                value = data[key]
                if isinstance(value, str) or not all(isinstance(v, (str, int)) for v in value):
                    raise ConfigError(f"rollout.server.{key}: expected a list of strings, got {value!r}")
                data[key] = [str(v) for v in value]
        settings = cls(**data)
        settings._check()
        return settings

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
