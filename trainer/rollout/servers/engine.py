"""``rollout.engine=vllm_server``: rollouts on vLLM OpenAI servers in processes of their own,
started by polyfsdp (``rollout.server.count``) or by someone else (``rollout.server.urls``, e.g.
on an inference node), the trained weights pushed to them through vLLM's weight-transfer
protocol after every optimizer step.

- Start (first :meth:`update_weights`): rank 0 writes the policy's config and weights to a
  directory and starts the servers on it, each under a keeper that ends it with the trainer
  (supervisor.py); with ``urls`` it connects and pushes the weights instead. The servers report
  weight version 1.
- Sync (:meth:`update_weights` after the policy's ``weights_version`` moved): every rank streams
  the full weights from the FSDP2 shards in buckets of ``rollout.sync_bucket_mb`` (LoRA merged);
  rank 0 sends them (weight_sender.py: pause, start, one update per bucket, finish with the new
  version, resume). Then every server must report the new version (a server that missed the sync
  stops the run) and ``rollout.check_sync`` compares server 0's log-probs of a probe sequence with
  the policy's, as for the colocated engine.
- Sampling (:meth:`generate`): one request per row with the row's seed (completions.py).
- Every request has one overall deadline, ``rollout.server.request_timeout_s``, and a cap on its
  answer's size (http.py); requests run on daemon threads, and a SIGTERM or Ctrl-C reaches the
  main thread while it waits for them (trainer/network_waits.py), so a server that drips its
  answer holds neither a failure nor a stop up.
- A vision-language policy (Qwen2-VL, Qwen2.5-VL): the run's processor is written beside the
  weights and the servers load it (vision_serving.py); a prompt's images travel with its tokens
  (completions.py), and ``check_sync`` adds the image probe, as for the colocated engine. Each
  sync's pause drops the servers' prefix and encoder caches (vLLM's ``/pause`` does), so nothing
  computed with the weights before is reused.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import re
import shutil
import tempfile
import time
import weakref

import torch

from polyfsdp.backends.distributed import broadcast_object, current_rank, current_world_size
from polyfsdp.engines.cancellation import cancellation_point
from polyfsdp.engines.model.weight_stream import full_weights, weight_buckets

from ...network_waits import DaemonPool, StoppedWhileWaiting
from ...rank_errors import on_every_rank
from ..engines import Completions, RolloutEngine, SamplingParams
from ..controls.stop_strings import cut_completions
from ..vllm import kv_cache_mb, refuse_probe_difference, served_positions, sync_error, sync_probe
from .completions import prompt_log_probs, sample_rows
from .http import Explain, ServerError, ServerHttp
from .vision_serving import MAX_IMAGES_PER_PROMPT, VisionServing, is_vision_language, prompt_pictures, vision_serving
from .launch import SERVED_MODEL_NAME, ServerLaunch, ServerProcess, free_ports, host_memory_share, server_environment
from .server_log import failure_line
from .weight_sender import CPU_TRANSFER, ServerWeightSender

logger = logging.getLogger(__name__)


class ServerRolloutEngine(RolloutEngine):
    """Rollouts on vLLM servers (module docstring); ``rollout`` is the RolloutSection,
    ``log_dir`` where the started servers write their logs (default: a temporary directory)."""

    name = "vllm_server"
    holds_weights = True
    samples_beside_training = True  # HTTP requests to processes of their own
    takes_images = True  # Qwen2-VL and Qwen2.5-VL policies (vision_serving.py)

    def __init__(self, rollout, backend, lora: bool = False, log_dir: str | None = None) -> None:
        self.rollout, self.backend = rollout, backend
        self.settings = rollout.server
        self.vllm = rollout.vllm
        self.log_dir = log_dir
        self.processes: list[ServerProcess] = []
        self.servers: list[ServerHttp] = []
        self.sender: ServerWeightSender | None = None
        self.model_dir: str | None = None
        self.model = SERVED_MODEL_NAME
        self.probe: list[int] = []
        self.vision: VisionServing | None = None  # a vision-language policy's, once started
        self.weight_version = 0
        self.served_dtype: str | None = None  # server 0's weights' dtype, where known (check_sync names a difference)
        self.last_sync_s: float | None = None
        self.last_sync_error: float | None = None
        self.last_sync_bytes = 0
        self._policy, self._policy_version = None, None
        self._pool: DaemonPool | None = None
        self._next_server = 0
        # What the weight stream yields (a seam for tests that drop a bucket on purpose).
        self.buckets = weight_buckets

    # ------------------------------------------------------------------ start
    def _write_model(self, policy) -> str | None:
        """The policy's config and weights in a new directory on rank 0 (None elsewhere); every
        rank joins the gathers."""
        from safetensors.torch import save_file

        rank0 = current_rank() == 0
        state = {}
        for name, tensor in full_weights(policy.module, untie=True):
            if rank0:
                state[name] = tensor.to("cpu", copy=True).contiguous()
        if not rank0:
            return None
        directory = tempfile.mkdtemp(prefix="polyfsdp-servers-")
        config = copy.deepcopy(policy.module.config)
        config.use_cache = True
        config.tie_word_embeddings = False  # the LM head is pushed as a weight of its own (vllm.py says why)
        if self.vision is not None:
            self.vision.write(directory, config)
        config.save_pretrained(directory)
        save_file(state, f"{directory}/model.safetensors", metadata={"format": "pt"})
        return directory

    def _launch(self, dtype: str) -> list[str]:
        """Start ``rollout.server.count`` servers on ``self.model_dir`` (rank 0); their URLs."""
        s, kv_mb = self.settings, kv_cache_mb(self.vllm.kv_cache_mb, self.backend)
        log_dir = self.log_dir or tempfile.mkdtemp(prefix="polyfsdp-server-logs-")
        ports = [s.port + i for i in range(s.count)] if s.port else free_ports(s.count)
        logger.info("starting %d rollout server(s) (logs: %s)", s.count, log_dir)
        for i, port in enumerate(ports):
            launch = ServerLaunch(self.model_dir, port, s.host, dtype, s.tensor_parallel_size,
                                  self.backend.server_weight_transfer,
                                  gpu_memory_utilization=self._memory_share(kv_mb),
                                  kv_cache_bytes=kv_mb << 20 if kv_mb else None, max_model_len=self.vllm.max_model_len,
                                  max_num_seqs=self.vllm.max_num_seqs, extra_args=s.extra_args,
                                  chunked_prefill=self.backend.vllm_chunked_prefill,
                                  images=MAX_IMAGES_PER_PROMPT if self.vision is not None else 0)
            devices = None if s.devices is None else s.devices[i]
            env = server_environment(devices, self.backend.server_devices_variable)
            process = ServerProcess(i, launch, env, os.path.join(log_dir, f"server_{i}.log"), s.request_timeout_s,
                                    cores=None if devices is None else self.backend.server_cores(devices))
            process.start()
            self.processes.append(process)
        deadline = time.monotonic() + s.start_timeout_s
        t0 = time.perf_counter()
        for process in self.processes:
            process.wait_ready(deadline)
        logger.info("%d rollout server(s) ready in %.1fs (logs: %s)", len(self.processes), time.perf_counter() - t0,
                    log_dir)
        for process in self.processes:
            process.http.request("/update_weight_version", {"new_version": "1"})
        return [p.url for p in self.processes]

    def _memory_share(self, kv_mb: int | None) -> float:
        """``--gpu-memory-utilization``: ``rollout.vllm.gpu_memory_utilization`` on a device, what
        the server needs where device memory is host memory (launch.py: host_memory_share)."""
        if not self.backend.memory_is_host:
            return self.vllm.gpu_memory_utilization
        return host_memory_share(self.model_dir, kv_mb, self.backend.memory_capacity_bytes())

    def _start(self, policy) -> None:
        s = self.settings
        config = policy.module.config
        self.probe = sync_probe(config, served_positions(config, self.vllm.max_model_len))
        if is_vision_language(config):
            self.vision = vision_serving(policy, self.processor_factory, self.probe, "rollout.engine=vllm_server")
        self.model_dir = self._write_model(policy) if s.started_here else None

        def rank0_servers():  # each server's URL and, for one started here, its log
            if current_rank() != 0:
                return None
            if s.started_here:
                self._launch(policy.engine_config.param_dtype)
                return [(p.url, p.log_path) for p in self.processes]
            return [(url, None) for url in s.urls]

        explain = self._connect(broadcast_object(on_every_rank(rank0_servers)))
        workers = on_every_rank(self._workers_per_server)
        address = s.transfer_address or (s.host if s.started_here else _this_host())
        transfer = self.backend.server_weight_transfer
        self.sender = ServerWeightSender([h.url for h in self.servers], workers, is_sender=current_rank() == 0,
                                         backend=transfer, master_address=address, timeout_s=s.request_timeout_s,
                                         device_sender=None if transfer == CPU_TRANSFER
                                         else self.backend.weight_transfer_sender, explain=explain)
        on_every_rank(lambda: self.sender.init() if current_rank() == 0 else None)
        if s.started_here:
            self.served_dtype = policy.engine_config.param_dtype  # what _launch started them with
        else:
            self.model = on_every_rank(self._served_model)
            self.served_dtype = broadcast_object(on_every_rank(
                lambda: server_dtype(self.servers[0]) if current_rank() == 0 else None))
            self._push(policy, version=1)

    def _connect(self, servers: list[tuple[str, str | None]]) -> list[Explain | None]:
        """Clients of ``servers`` (each its URL and, for one started here, its log) and the pool
        their requests run on; returns what completes a failure's line of each (:meth:`_explainer`)."""
        explain = [self._explainer(i, log_path) for i, (_, log_path) in enumerate(servers)]
        self.servers = [ServerHttp(url, f"rollout server {i}", self.settings.request_timeout_s, how)
                        for i, ((url, _), how) in enumerate(zip(servers, explain))]
        # Daemon threads: a request blocked on a server that does not answer never holds the exit,
        # and sample_rows' wait on the main thread reads the job's stop flag (trainer/network_waits.py).
        self._pool = DaemonPool(self.settings.max_concurrent_requests, "rollout-request")
        return explain

    def _explainer(self, index: int, log_path: str | None) -> Explain | None:
        """What completes a failure's line of server ``index``: on rank 0, which started it, its
        process's (exit code, log, root cause); elsewhere its log and root cause (the log is on rank
        0's node: readable here when that is this node); None for a server started by someone else."""
        if log_path is None:
            return None
        if self.processes:
            return self.processes[index].explain_failure
        return functools.partial(failure_line, log_path=log_path)

    def _workers_per_server(self) -> list[int]:
        if self.settings.started_here:
            return [self.settings.tensor_parallel_size] * len(self.servers)
        sizes = []
        for http in self.servers:
            answer = http.request("/get_world_size", method="GET")
            size = answer.get("world_size") if isinstance(answer, dict) else answer
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ServerError(f"{http.name} ({http.url}) GET /get_world_size: expected a worker count, got "
                                  f"{answer!r}")
            sizes.append(size)
        return sizes

    def _served_model(self) -> str:
        answer = self.servers[0].request("/v1/models", method="GET")
        try:
            return str(answer["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"{self.servers[0].name} ({self.servers[0].url}) GET /v1/models: no model listed") \
                from None

    # ------------------------------------------------------------------ weights
    def _push(self, policy, version: int) -> None:
        """Stream the policy's weights to every server as ``version`` (collective)."""
        buckets = self.buckets(policy.module, int(self.rollout.sync_bucket_mb * (1 << 20)), untie=True)

        def send():
            try:
                self.last_sync_bytes = self.sender.push(buckets, version)
            finally:
                for _ in buckets:  # a failed send still joins the peers' remaining gathers
                    pass

        on_every_rank(send)

    def _confirm_version(self) -> None:
        """Every server must serve ``self.weight_version``: one that missed a sync stops the run."""
        for http in self.servers:
            answer = http.request("/weight_info", method="GET")
            served = answer.get("weight_version") if isinstance(answer, dict) else None
            if str(served) != str(self.weight_version):
                raise ServerError(f"{http.name} ({http.url}) serves weight version {served!r}, the trainer pushed "
                                  f"{self.weight_version}: it missed a sync (restarted, or another trainer pushed "
                                  f"to it); nothing is sampled from it; restart the run (resume=auto)")

    def update_weights(self, policy) -> None:
        current = self._policy() if self._policy is not None else None
        if self.servers and current is policy and self._policy_version == policy.weights_version:
            return
        t0 = time.perf_counter()
        with policy.eval_mode():
            if not self.servers:
                self._start(policy)
            else:
                self._push(policy, self.weight_version + 1)
        self.weight_version += 1
        self.last_sync_s = time.perf_counter() - t0
        self._policy, self._policy_version = weakref.ref(policy), policy.weights_version
        on_every_rank(self._confirm_version)
        if self.rollout.check_sync:
            self.check(policy)

    def check(self, policy) -> float:
        """Server 0's vs the policy's log-probs of the probe; ServerError beyond ``rollout.check_sync_tol``
        (collective)."""
        def sampled(ids, picture):  # asked once, by rank 0: every rank checks the same server's answer
            image_token = None if picture is None else self.vision.image_token_id
            return broadcast_object(on_every_rank(
                lambda: prompt_log_probs(self.servers[0], self.model, ids, picture, image_token)
                if current_rank() == 0 else None))

        self.last_sync_error = sync_error(policy, self.probe, self.vision, sampled)
        refuse_probe_difference(self.last_sync_error, self.rollout.check_sync_tol, self.weight_version,
                                "the rollout server", ServerError,
                                dtype_difference(self.served_dtype, policy.engine_config.param_dtype))
        return self.last_sync_error

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None,
                 images: list | None = None) -> Completions:
        """``images``: one Example (its ``images``, as encoded into the prompt) or None per prompt."""
        if not self.servers:
            raise RuntimeError("rollout.engine=vllm_server: generate() before update_weights(policy) started the "
                               "servers")
        seeds = list(seeds) if seeds is not None else torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        for process in self.processes:
            reason = process.died()
            if reason is not None:
                raise ServerError(reason)
        # Spread this rank's rows from a different server than its peers start from.
        first = (self._next_server + current_rank()) % len(self.servers)
        # A server failing on one rank must stop every rank (what follows a rollout is collective).
        try:
            tokens, log_probs = on_every_rank(lambda: sample_rows(
                self.servers, self.model, prompts, params, seeds, self._pool, first,
                prompt_pictures(images, self.vision, "rollout.engine=vllm_server"), self.vision))
        except StoppedWhileWaiting:
            # A SIGTERM while the rows were out. On one rank, a step that has not updated the weights
            # yet is abandoned here as at its other cancellation points: the boundary's checkpoint is
            # saved (trainer/run/stop.py). Several ranks cannot agree from here (a peer may already be
            # in the next collective): the run stops now, from its last checkpoint.
            if current_world_size() == 1:
                cancellation_point()
            raise
        self._next_server += len(prompts)
        return Completions(*cut_completions(tokens, log_probs, params))

    def close(self) -> None:
        if self.sender is not None:
            try:
                self.sender.close()
            except Exception as exc:  # noqa: BLE001 - closing must go on to stop the servers
                logger.warning("rollout servers: closing the weight transfer failed: %s", exc)
            self.sender = None
        for process in self.processes:
            process.stop()
        self.processes, self.servers = [], []
        if self._pool is not None:
            self._pool.close()  # never waits: a request still running ends at its deadline
            self._pool = None
        if self.model_dir is not None:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            self.model_dir = None


_DTYPE_IN_CONFIG = re.compile(r"\bdtype=(?:torch\.)?(\w+)")


def server_dtype(http: ServerHttp) -> str | None:
    """The dtype a vLLM server holds its weights in (``float32``), from its ``/server_info`` (a
    route of ``VLLM_SERVER_DEV_MODE=1``, which the weight-transfer routes need too): its config as
    text (``... dtype=torch.bfloat16, ...``) or as JSON (``model_config.dtype``); None where the
    server does not say (an older vLLM): check_sync's failure then names no dtype."""
    try:
        answer = http.request("/server_info", method="GET")
    except ServerError:
        return None
    config = answer.get("vllm_config") if isinstance(answer, dict) else None
    if isinstance(config, dict):
        config = f"dtype={(config.get('model_config') or {}).get('dtype')}"
    match = _DTYPE_IN_CONFIG.search(config) if isinstance(config, str) else None
    return match.group(1) if match else None


def dtype_difference(served: str | None, trained: str) -> str | None:
    """check_sync's likely cause when the server holds its weights in another dtype than the
    policy's parameters (``trained``: ``engine.param_dtype``): its log-probs then differ by the
    rounding of that dtype, a sync or none; None when they agree or the server's is unknown."""
    if served is None or served == trained:
        return None
    return (f"the server holds its weights in {served} and the policy trains in {trained} (engine.param_dtype), "
            f"a difference that rounds every log-prob: likely the cause, rather than a missed sync; start the "
            f"server with --dtype {trained} (python -m polyfsdp.trainer.rollout.servers.launch ... --dtype "
            f"{trained})")


def _this_host() -> str:
    import socket

    return socket.gethostbyname(socket.gethostname())
