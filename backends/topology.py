"""Which rank is which, and which ranks share a batch: the one owner of the rank topology
(docs/architecture.md, "Ranks, replicas and sequence-parallel groups").

torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are read here and nowhere else
(:func:`launch_env`; ``tests/cpu/backends/test_topology.py`` holds every other module to it). Once
the process group exists, :func:`topology` gives the :class:`Topology` of a
sequence-parallel degree: the ranks ``r * sp ... r * sp + sp - 1`` form data-parallel
replica ``r`` (one sequence-parallel group, holding one batch), built once per degree with
its ``(dp, sp)`` device mesh, and handed to every caller that asks for that degree.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

# torch loads on first use, not on import: polyfsdp-train's --help and config errors ask
# launch_env() for the rank before anything imports torch (tests/cpu/trainer/test_cli_startup.py).
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun) says about this process, before any process group exists."""

    rank: int
    world_size: int
    local_rank: int


def launch_env() -> LaunchEnv:
    """torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (0, 1, 0 without a launcher)."""
    return LaunchEnv(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0))


def node_count() -> int:
    """How many nodes the launch spans: the world size over torchrun's ``LOCAL_WORLD_SIZE`` (the
    processes on each node); 1 without a launcher or without that variable."""
    world_size = launch_env().world_size
    per_node = _env_int("LOCAL_WORLD_SIZE", world_size)
    return world_size // per_node if 0 < per_node < world_size else 1


@dataclass(frozen=True)
class Topology:
    """This rank's place: world size, rank, local rank (its device index), the
    sequence-parallel degree ``sp_size`` and, derived, the data-parallel degree ``dp_size``,
    this rank's ``replica`` (its data-parallel rank) and ``sp_rank`` (its rank within the
    replica's SP group). ``mesh`` is the ``(dp, sp)`` device mesh (None for sp = 1 or without
    a process group); FSDP shards over ``fsdp_mesh``, all ranks."""

    world_size: int
    rank: int
    local_rank: int
    sp_size: int = 1
    fsdp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.sp_size < 1 or self.world_size % self.sp_size:
            raise ValueError(f"ulysses_sp_size={self.sp_size} must divide the world size {self.world_size}")

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas there are."""
        return self.world_size // self.sp_size

    @property
    def replica(self) -> int:
        """This rank's data-parallel rank: the replica (SP group) it belongs to."""
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        """This rank's place within its SP group (which shard of a row it runs)."""
        return self.rank % self.sp_size

    @property
    def sp_group(self):
        """The process group of this rank's SP group (None for sp = 1)."""
        return None if self.mesh is None else self.mesh.get_group("sp")

    @property
    def dp_group(self):
        """The process group of the ranks holding the same place in every replica (None for sp = 1)."""
        return None if self.mesh is None else self.mesh.get_group("dp")

    def replica_share(self, items: Sequence, what: str = "items") -> list:
        """This replica's contiguous share of a global list (every rank of one SP group gets
        the same share); the list's length must be a multiple of ``dp_size``."""
        if len(items) % self.dp_size:
            raise ValueError(f"{len(items)} {what} do not split over {self.dp_size} data-parallel replicas")
        start = self.share_start(len(items))
        return list(items[start:start + len(items) // self.dp_size])

    def share_start(self, count: int) -> int:
        """The global index of the first item of this replica's share of ``count`` items."""
        return self.replica * (count // self.dp_size)

    def one_per_replica(self, per_rank: Sequence[Any]) -> list[Any]:
        """From a value per rank (in rank order, e.g. ``all_gather_object``'s result), the first
        SP rank's of each replica: the replica's value, when its ranks hold the same."""
        return list(per_rank[::self.sp_size])


# One Topology per sequence-parallel degree, for the process group they were built on.
_BUILT: dict[int, Topology] = {}
_GROUP_ID: list[int] = []  # id() of the default process group the cache belongs to
_job_sp_size = 1  # the degree a bare topology() returns: what init_distributed was told


def group_exists() -> bool:
    """Whether a default process group is initialised (torch.distributed loads on this call)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def set_job_sp_size(sp_size: int) -> None:
    """Record the job's sequence-parallel degree: what :func:`topology` returns without one."""
    global _job_sp_size
    _job_sp_size = sp_size


def topology(sp_size: int | None = None, device_type: str | None = None) -> Topology:
    """The topology of ``sp_size`` (default: the job's, see :func:`set_job_sp_size`), built
    once per process group. Building one with sp > 1 creates its ``(dp, sp)`` mesh, a
    collective: every rank asks for the same degree at the same point (``device_type``, the
    backend's, is needed then). Without a process group: rank 0 of a world of one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sp_size = _job_sp_size if sp_size is None else sp_size
    if not group_exists():
        return Topology(1, 0, launch_env().local_rank, sp_size)
    group = id(dist.group.WORLD)
    if _GROUP_ID != [group]:
        _BUILT.clear()
        _GROUP_ID[:] = [group]
    built = _BUILT.get(sp_size)
    if built is not None:
        return built
    world, rank = dist.get_world_size(), dist.get_rank()
    Topology(world, rank, 0, sp_size)  # refuse a degree that does not divide the world before any collective
    fsdp_mesh = mesh = None
    if device_type is not None:
        base = _BUILT.get(1)
        fsdp_mesh = base.fsdp_mesh if base is not None and base.fsdp_mesh is not None else \
            init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
        if sp_size > 1:
            mesh = init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    elif sp_size > 1:
        raise ValueError(f"topology(sp_size={sp_size}): the first call for a degree > 1 needs the device type "
                         f"(it builds the (dp, sp) mesh)")
    built = Topology(world, rank, launch_env().local_rank, sp_size, fsdp_mesh, mesh)
    if device_type is not None:
        _BUILT[sp_size] = built  # a topology without meshes is not kept: a later call may build them
    return built


def forget_topologies() -> None:
    """Drop the built topologies (the process group they belong to is going away)."""
    _BUILT.clear()
    _GROUP_ID.clear()
