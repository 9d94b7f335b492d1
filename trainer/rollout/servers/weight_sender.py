"""The trainer side of pushing weights to vLLM OpenAI servers through vLLM's weight-transfer routes.

Rank 0 of the trainer is the sender: it drives the servers' control routes over HTTP and broadcasts the
bytes to their workers in a group of its own (sender = rank 0, then each server's workers). The other
trainer ranks only iterate the buckets, whose gathers are collectives among the trainer ranks.

The default backend "polyfsdp_cpu" needs no vLLM here (the trainer may run without it); the servers
load the matching worker engine through polyfsdp's vLLM plugin (``vllm_plugin.py``).
"""
import threading
from concurrent.futures import Future
from typing import Iterable

import torch

from polyfsdp.trainer.rollout.servers import gloo_wire
from polyfsdp.trainer.rollout.servers.http import Explain, Fanout, ServerError, wait_all

CPU_TRANSFER = gloo_wire.BACKEND  # the backend trainer/rollout/servers/cpu_transfer.py registers in vLLM

Bucket = list[tuple[str, torch.Tensor]]


def _in_background(fn) -> Future:
    """Run ``fn`` on a daemon thread: joining a group blocks until every peer arrives, and when a
    server failed to start its side the trainer must be able to raise (and exit) without waiting."""
    future: Future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as err:  # handed to whoever reads the future
            future.set_exception(err)

    threading.Thread(target=run, daemon=True, name="weight-transfer-join").start()
    return future


class GlooSender:
    """Sender end of "polyfsdp_cpu": one uint8 buffer per bucket, broadcast over gloo."""

    def __init__(self, master_address: str, master_port: int, world_size: int, timeout_s: float):
        self.address, self.world_size, self.timeout_s = master_address, world_size, timeout_s
        self.store = gloo_wire.master_store(master_address, master_port, timeout_s)
        self.port = self.store.port
        self.group = None

    def worker_init_info(self, rank_offset: int) -> dict:
        return dict(master_address=self.address, master_port=self.port, rank_offset=rank_offset,
                    world_size=self.world_size, timeout_s=self.timeout_s)

    def connect(self) -> None:
        self.group = gloo_wire.join_group(self.store, self.address, self.port, 0, self.world_size, self.timeout_s)

    def send(self, tensors: list[torch.Tensor], requests: list[Future]) -> int:
        buffer = gloo_wire.pack(tensors)
        work = gloo_wire.broadcast(self.group, buffer)
        wait_all(requests)  # the servers answer once their workers received and loaded the bucket
        work.wait()
        return buffer.numel()

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self.group = self.store = None


class ServerWeightSender:
    """Pushes weights to vLLM servers after an optimizer step (every trainer rank makes one).

    ``urls[i]`` is a server with ``workers_per_server[i]`` workers (its tensor x pipeline parallel
    size); the servers run with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
    '{"backend": BACKEND}'``. ``device_sender``: for a device's own backend (vLLM's NCCL on
    GPUs), the backend's ``weight_transfer_sender`` (backends/), which makes the trainer's end;
    None for ``polyfsdp_cpu`` (default), whose end is :class:`GlooSender`. ``explain[i]``: what
    completes a failure's line of server ``i`` (http.py's ``ServerHttp``; None: nothing).
    """

    def __init__(self, urls: list[str], workers_per_server: list[int], *, is_sender: bool,
                 backend: str = CPU_TRANSFER, master_address: str = "127.0.0.1", master_port: int = 0,
                 timeout_s: float = 600.0, device_sender=None, explain: list[Explain | None] | None = None):
        if len(urls) != len(workers_per_server) or not urls or min(workers_per_server) < 1:
            raise ValueError(f"need one worker count >= 1 per server URL: {urls} and {workers_per_server}")
        if (backend == CPU_TRANSFER) != (device_sender is None):
            raise ValueError(f"backend {backend!r}: {CPU_TRANSFER} takes no device sender, any other needs one")
        self.urls, self.is_sender, self.backend, self.device_sender = list(urls), is_sender, backend, device_sender
        self.master_address, self.master_port, self.timeout_s = master_address, master_port, timeout_s
        self.explain = explain
        self.world_size = 1 + sum(workers_per_server)
        # Server i's workers follow the sender and the workers of servers 0..i-1.
        self.rank_offsets = [1 + sum(workers_per_server[:i]) for i in range(len(urls))]
        self._transport = None
        self._http = None
        self._failed = None  # why the last push failed: the group is then out of step

    def init(self) -> None:
        """Sender only (a no-op elsewhere): open the group and have every server's workers join it."""
        if not self.is_sender:
            return
        if self._transport is not None:
            raise RuntimeError("ServerWeightSender.init() called twice; close() first")
        if self.device_sender is not None:
            transport = self.device_sender(self.master_address, self.master_port, self.world_size)
        else:
            transport = GlooSender(self.master_address, self.master_port, self.world_size, self.timeout_s)
        http = Fanout(self.urls, self.timeout_s, self.explain)
        joined = _in_background(transport.connect)
        try:
            wait_all(http.submit("/init_weight_transfer_engine",
                                 each=[{"init_info": transport.worker_init_info(o)} for o in self.rank_offsets]),
                     http.what)
            try:
                joined.result(timeout=self.timeout_s)
            except TimeoutError:
                raise ServerError(f"the workers of {self.urls} did not join the weight-transfer group "
                                         f"within {self.timeout_s} s") from None
        except BaseException:
            http.close()
            transport.close()  # the joining thread, if still blocked, ends at its timeout
            raise
        self._transport, self._http, self._failed = transport, http, None

    def push(self, buckets: Iterable[Bucket], version: int) -> int:
        """Send every bucket's tensors to every server; returns the bytes broadcast (the sender's count,
        alignment padding included; 0 on other ranks). The servers are paused (requests kept) during the
        update and resumed only after every server finished it: a failed push leaves them paused and
        raises, so no server samples from half-synced weights; so does one that left a layer of a
        server's model without weights ("polyfsdp_cpu": its workers check)."""
        if not self.is_sender:
            for _ in buckets:  # the gathers behind the iteration are collectives with the sender
                pass
            return 0
        sent, error = 0, None
        if self._transport is None:
            error = RuntimeError("ServerWeightSender.push() before init()")
        elif self._failed is not None:
            error = RuntimeError(f"an earlier push failed ({self._failed}); close() and init() again")
        else:
            try:
                self._http.call("/pause?mode=keep")
                self._http.call("/start_weight_update")
            except Exception as err:
                error = err
        for bucket in buckets:
            if error is not None or not bucket:
                continue  # keep iterating: the other trainer ranks' gathers need this rank
            try:
                sent += self._send_bucket(bucket)
            except Exception as err:
                error = err
        if error is None and self.device_sender is None:
            try:  # "polyfsdp_cpu"'s workers name the layers the buckets left without weights (cpu_transfer.py)
                self._http.call("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": [],
                                                                    "check": True}})
            except Exception as err:
                error = err
        if error is None:
            try:
                self._http.call("/finish_weight_update", {"weight_version": str(version)})
            except Exception as err:
                error = err
        if error is not None:
            if self._transport is not None:
                self._failed = str(error)
            raise error
        self._http.call("/resume")
        return sent

    def _send_bucket(self, bucket: Bucket) -> int:
        tensors = [tensor for _, tensor in bucket]
        info = {"names": [name for name, _ in bucket],
                "dtype_names": [gloo_wire.dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        return self._transport.send(tensors, self._http.submit("/update_weights", {"update_info": info}))

    def close(self) -> None:
        """Best effort: tell the servers to leave the group, then release this side of it."""
        if self._transport is None:
            return
        for http in self._http.servers:
            try:
                http.request("/shutdown_weight_transfer_engine", timeout_s=min(self.timeout_s, 30.0))
            except Exception:
                pass  # a server that is gone or mid-update has nothing to release here
        self._transport.close()
        self._http.close()
        self._transport = self._http = None
