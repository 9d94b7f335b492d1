"""torch.distributed set-up from torchrun's environment, on any backend, and the collectives
the rest of polyfsdp calls (each one a no-op on a single rank)."""
from __future__ import annotations

import ctypes
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .base import Backend
from .topology import forget_topologies, group_exists, launch_env, set_job_sp_size, topology

logger = logging.getLogger(__name__)


def current_rank() -> int:
    """This process's rank, 0 when no process group is initialised."""
    return dist.get_rank() if group_exists() else 0


def current_world_size() -> int:
    """The number of ranks, 1 when no process group is initialised."""
    return dist.get_world_size() if group_exists() else 1


# ----------------------------------------------------------------------------- collectives
# Each helper is a no-op on one rank (no process group, or a group of one), so callers
# never guard a collective themselves.


def _all_reduce(values: list[float] | torch.Tensor, device, op, caller: str, group=None
                ) -> list[float] | torch.Tensor:
    if isinstance(values, torch.Tensor):
        if current_world_size() > 1:
            dist.all_reduce(values, op=op, group=group)
        return values
    if device is None:
        # nccl and hccl reduce only device tensors: the caller must say which device.
        raise TypeError(f"{caller}: a list of values needs device= (the backend's device)")
    if not values or current_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device | str | None = None, group=None
                   ) -> list[float] | torch.Tensor:
    """Element-wise sum over ranks (over ``group``'s ranks when given, e.g. a topology's
    ``dp_group``: each data-parallel replica once). A tensor is reduced in place and
    returned; a list of floats is reduced as float64 on ``device`` and returned as a new
    list. One rank: the input."""
    return _all_reduce(values, device, dist.ReduceOp.SUM, "all_reduce_sum", group)


def all_reduce_max(values: list[float] | torch.Tensor, device: torch.device | str | None = None, group=None
                   ) -> list[float] | torch.Tensor:
    """Element-wise maximum over ranks; same inputs and return as :func:`all_reduce_sum`."""
    return _all_reduce(values, device, dist.ReduceOp.MAX, "all_reduce_max", group)


def sum_over_replicas(values: list[float], device) -> list[float]:
    """The sum of per-replica values over the data-parallel replicas, each counted once (the
    ranks of one sequence-parallel group hold the same ones): what batch statistics such as
    whitening's unbiased variance need (backends/topology.py)."""
    return all_reduce_sum(values, device, group=topology().dp_group)


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` on one rank."""
    if current_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * current_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` (picklable) on every rank; ``value`` itself on one rank."""
    if current_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object_in(value: Any, group) -> list[Any]:
    """Every rank's ``value`` (picklable) within ``group``, in group-rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return [value]
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dim 0 goes to group rank ``i``; the result's chunk ``j`` came from rank ``j``.
    Its own transpose, so the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    """``(size, *shape)``: every group rank's tensor. Backward: each rank's gradient of every
    copy is sent to the copy's owner (an all-to-all, which gloo has, unlike reduce-scatter) and summed."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group).sum(0), None


def all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all within ``group`` (any backend: gloo, nccl, hccl): ``tensor``'s
    dim 0 has the group's size; chunk ``i`` is sent to group rank ``i`` and the result's chunk
    ``j`` is the one rank ``j`` sent here. The input itself on a group of one."""
    size = dist.get_world_size(group) if group_exists() else 1
    if tensor.shape[0] != size:
        raise ValueError(f"all_to_all: dim 0 must be the group size {size}, got shape {tuple(tensor.shape)}")
    return tensor if size == 1 else _AllToAll.apply(tensor, group)


def all_gather_differentiable(tensor: torch.Tensor, group) -> torch.Tensor:
    """``(group size, *tensor.shape)`` holding every group rank's ``tensor`` in rank order,
    with gradients flowing back to each owner (summed over the ranks that used it)."""
    if not group_exists() or dist.get_world_size(group) == 1:
        return tensor.unsqueeze(0)
    return _AllGather.apply(tensor, group)


def sequence_parallel_mesh(device_type: str, sp_size: int) -> DeviceMesh:
    """The ``(dp, sp)`` mesh of ``sp_size`` (backends/topology.py: consecutive ranks form one
    sequence-parallel group, ``mesh.get_group("sp")``, and ranks with equal position in their
    group one data-parallel group, ``"dp"``), built once. Every rank must call it together."""
    return topology(sp_size, device_type).mesh


def barrier(group=None) -> None:
    """Wait until every rank (of ``group``, default all) arrives; a no-op when no process group
    is initialised."""
    if group_exists():
        dist.barrier(group=group)


_BACKGROUND_GROUP: list = []
_HOST_FLAG_GROUP: list = []


def _gloo_group(held: list):
    """The gloo group over all ranks kept in ``held``, created on the first call (which every
    rank must make at the same point); None without a process group."""
    if not group_exists():
        return None
    if not held:
        held.append(dist.new_group(backend="gloo"))
    return held[0]


def background_group():
    """A second process group over all ranks, on gloo (host memory), for collectives of a
    background thread (an asynchronous checkpoint save) that must never interleave with the
    training's on the default group. Created on the first call, which every rank must make at
    the same point; None without a process group."""
    return _gloo_group(_BACKGROUND_GROUP)


def host_flag_group():
    """A gloo group over all ranks for the training thread's host-side agreements that are made
    often and must not wait for the device (a SIGTERM flag agreed before every micro-batch: on the
    default group it would sync the device each time). Created on the first call, which every rank
    must make at the same point; None on one rank or without a process group."""
    return _gloo_group(_HOST_FLAG_GROUP) if current_world_size() > 1 else None


def init_distributed(backend: Backend, timeout_s: float | None = None, sp_size: int | None = None) -> DeviceMesh:
    """Initialise the process group from torchrun's variables (or a single-process group
    when they are absent), bind the device, and return the 1-D ``DeviceMesh`` over all ranks
    (the topology's ``fsdp_mesh``). ``sp_size`` sets the job's sequence-parallel degree
    (backends/topology.py; its ``(dp, sp)`` mesh is built now). Before the group starts, the
    backend sets what its collective library reads from the environment
    (``Backend.prepare_process_group``: HCCL's timeouts on NPUs, logged once by rank 0);
    ``timeout_s`` (default: the backend's) is torch's process-group timeout."""
    env = launch_env()
    rank, world_size = env.rank, env.world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world_size})")
    backend.set_device(env.local_rank)
    if not dist.is_initialized():
        backend_timeout_s, settings = backend.prepare_process_group(os.environ)
        timeout_s = backend_timeout_s if timeout_s is None else timeout_s
        if settings is not None and rank == 0:
            logger.info("%s", settings)
        if "MASTER_ADDR" not in os.environ:
            if world_size != 1:
                raise ValueError(f"WORLD_SIZE={world_size} but MASTER_ADDR is unset: launch with torchrun")
            # Single process: a private store, so two jobs on one host never collide on a port.
            store = dist.HashStore()
            dist.init_process_group(backend.dist_backend, store=store, rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend.dist_backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        logger.debug("initialised %s process group: rank %d of %d", backend.dist_backend, rank, world_size)
    _record_peers()
    mesh = topology(1, backend.device_type).fsdp_mesh
    if sp_size is not None:
        topology(sp_size, backend.device_type)  # refuses a degree that does not divide the world
        set_job_sp_size(sp_size)
    return mesh


# ----------------------------------------------------------------------------- lost peers
# Every rank's (host, pid), gathered once at set-up, so that a rank whose collective fails
# because a peer died can say which one: on its own host, by checking which pids are gone.
_PEERS: list[tuple[str, int]] = []

# What gloo, nccl and hccl say (inside RuntimeError / DistError) when a peer stops answering.
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                        "timed out", "Socket Timeout", "NCCL communicator was aborted")


def _record_peers() -> None:
    global _PEERS
    _PEERS = all_gather_object((socket.gethostname(), os.getpid()))


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` on this host has ended (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # A killed worker stays a zombie until its launcher reaps it: state Z (or X).
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


# A killed peer's sockets close before its process is a zombie: how long a rank that saw the
# connection drop looks for the process's end before saying the peer stopped answering.
LOST_PEER_WAIT_S = 3.0


def lost_peers(wait_s: float = LOST_PEER_WAIT_S) -> list[int]:
    """Ranks on this host whose process has ended (from the table gathered at set-up),
    looking for up to ``wait_s`` seconds."""
    host = socket.gethostname()
    deadline = time.monotonic() + wait_s
    while True:
        lost = [rank for rank, (peer_host, pid) in enumerate(_PEERS)
                if rank != current_rank() and peer_host == host and process_gone(pid)]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.05)


def collective_failure(exc: BaseException) -> str | None:
    """A one-line description when ``exc`` is a collective that failed because a peer rank
    died or stopped answering (None for any other error): which rank's process ended, when
    that can be seen from here."""
    dist_error = getattr(dist, "DistError", ())
    text = " ".join(str(exc).split())
    if not (isinstance(exc, dist_error) or (isinstance(exc, RuntimeError)
                                            and any(m in text for m in PEER_FAILURE_MARKERS))):
        return None
    if len(_PEERS) < 2:
        return None
    lost = lost_peers()
    detail = text[:160] + ("..." if len(text) > 160 else "")
    if lost:
        names = ", ".join(f"rank {r} (pid {_PEERS[r][1]})" for r in lost)
        return (f"lost {names}: its process ended during a collective (it crashed or was killed; its own "
                f"output says why), so this rank stops too [{detail}]")
    return (f"a collective failed because a peer rank stopped answering (it died on another host, hung, or "
            f"exceeded the process-group timeout) [{detail}]")


def destroy_distributed(wait_for_peers: bool = True) -> None:
    """Tear the process group down if one exists. By default all ranks first meet at a
    barrier (gloo has aborted at exit when one rank left while a peer still sent); pass
    ``wait_for_peers=False`` on an error path, where a peer may never arrive."""
    if not dist.is_initialized():
        return
    forget_topologies()
    set_job_sp_size(1)
    if wait_for_peers:
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        _keep_until_exit(barrier)
    _BACKGROUND_GROUP.clear()
    _HOST_FLAG_GROUP.clear()
    dist.destroy_process_group()


# Work handles that must outlive the interpreter's finalisation; see _keep_until_exit.
_KEPT_WORK: list = []


def _keep_until_exit(work) -> None:
    """Never free ``work`` (a finished collective's handle).

    destroy_process_group() does not stop the process group's worker threads while model
    shards (FSDP, DeviceMesh) still refer to the group. Gloo's barrier work holds every
    collective that was still in flight when it was queued (FSDP's last all-gather, whose
    buffers are Python tensors), and a worker thread drops its reference a moment after the
    barrier completes. When that drop is the last one and lands after Python has begun to
    finalise, freeing those tensors takes the GIL from a non-Python thread, which kills the
    thread inside a noexcept destructor: "terminate called without an active exception",
    SIGABRT, after a run that finished (seen on 2 loaded cores, about 1 exit in 40; torch
    2.13, Python 3.11). Holding one extra reference that is never released means the
    worker's drop is never the last, so nothing it frees needs the GIL. The cost is the
    barrier's small bookkeeping, once per process group."""
    _KEPT_WORK.append(work)
    # The list alone is cleared while Python finalises; this reference never is.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
