"""The rank topology's one owner (backends/topology.py): replicas, SP ranks and shares, and a
guard that no other module reads torchrun's rank variables or recomputes replicas."""
from __future__ import annotations

import ast
import re

import pytest

from tests.helpers import ROOT
from polyfsdp.backends.topology import Topology, launch_env, topology

CHECKED_FOLDERS = ("backends", "engines", "patches", "trainer", "benchmarks")
OWNER = ROOT / "backends" / "topology.py"
LAUNCH_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE"}
# A replica computed by hand from a rank (what dp_balance once did with `current_rank() // sp`).
REPLICA_BY_HAND = re.compile(r"(current_rank\(\)|\brank\b)\s*(//|%)\s*\w*sp")


def _violations_in(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in LAUNCH_VARIABLES:
            found.append(f"{where}:{node.lineno}: reads {node.value!r}")
    for number, line in enumerate(source.splitlines(), start=1):
        if REPLICA_BY_HAND.search(line):
            found.append(f"{where}:{number}: computes a replica by hand: {line.strip()}")
    return found


def _violations() -> list[str]:
    found = []
    for folder in CHECKED_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != OWNER:
                found += _violations_in(path.read_text(), str(path.relative_to(ROOT)))
    return found


def test_the_guard_catches_env_reads_and_hand_made_replicas():
    for source in ('os.environ["RANK"]', 'os.environ.get("LOCAL_RANK", "0")', 'int(os.getenv("WORLD_SIZE"))',
                   "replica = current_rank() // sp_size", "group = rank % sp"):
        assert _violations_in(source, "x.py"), source
    for source in ('print("RANK=1")', "f'WORLD_SIZE={n}'", "topo.replica", "rank // 2"):
        assert not _violations_in(source, "x.py"), source


def test_no_module_but_the_topology_owner_reads_the_launch_variables():
    violations = _violations()
    assert not violations, "outside backends/topology.py:\n" + "\n".join(violations)


def test_replicas_and_sp_ranks_of_a_dp2_sp2_world():
    places = [Topology(4, rank, rank, sp_size=2) for rank in range(4)]
    assert [(t.replica, t.sp_rank, t.dp_size) for t in places] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    items = list("abcdefgh")
    # The ranks of one SP group share their replica's contiguous half.
    assert [t.replica_share(items) for t in places] == [list("abcd"), list("abcd"), list("efgh"), list("efgh")]
    assert places[3].one_per_replica(["r0", "r1", "r2", "r3"]) == ["r0", "r2"]


def test_a_share_that_does_not_split_and_a_degree_that_does_not_divide_are_refused():
    with pytest.raises(ValueError, match="3 prompts do not split over 2 data-parallel replicas"):
        Topology(4, 0, 0, sp_size=2).replica_share([1, 2, 3], "prompts")
    with pytest.raises(ValueError, match="ulysses_sp_size=3 must divide the world size 4"):
        Topology(4, 0, 0, sp_size=3)


def test_without_a_process_group_the_topology_is_one_rank(monkeypatch):
    from polyfsdp.backends import topology as owner

    monkeypatch.setattr(owner, "group_exists", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    topo = topology(1)
    assert (topo.world_size, topo.rank, topo.local_rank, topo.dp_size, topo.replica) == (1, 0, 3, 1, 0)
    assert launch_env().local_rank == 3
