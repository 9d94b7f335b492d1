"""Two "nodes" on this machine: ``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 1`` with
the c10d rendezvous, one process per node, runs the job and logs what the single-node 2-rank run
logs (every numeric field but the times). The two-node run also writes its checkpoints in the
background (``trainer.async_checkpoint``), which must not change a number either."""
from __future__ import annotations

import os
import subprocess
import sys

from test_trainer_torchrun import OVERRIDES, _launch
from torchrun_launcher import free_port

from polyfsdp.trainer.tracking.metrics import TIMING_KEYS, read_metrics


def _numbers(out):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and not isinstance(v, str) or k in ("phase", "tag")}
            for r in read_metrics(str(out / "metrics.jsonl"))]


def _two_nodes(out, *extra: str) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                               "--rdzv-id", "polyfsdp-test", "-m", "polyfsdp.trainer.train", *OVERRIDES, *extra,
                               f"trainer.output_dir={out}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for node in (0, 1)]
    done = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    return done


def test_two_nodes_of_one_process_equal_one_node_of_two(tmp_path):
    nodes = _two_nodes(tmp_path / "nodes", "trainer.async_checkpoint=true")
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    assert sum("2 rank(s)" in node.stdout for node in nodes) == 1  # rank 0 speaks, on whichever node it is
    single = _launch(tmp_path / "single", 2)
    assert single.returncode == 0, single.stderr[-3000:]
    multi, one = _numbers(tmp_path / "nodes"), _numbers(tmp_path / "single")
    assert [r["phase"] for r in multi] == [r["phase"] for r in one] and any(r["phase"] == "rl" for r in one)
    assert multi == one
    rl = tmp_path / "nodes" / "checkpoints" / "rl"
    assert (rl / "latest").read_text().strip() == "step_000002"
    assert sum(f"checkpoint saved: {rl / 'step_000002'}" in node.stdout for node in nodes) == 1
    assert {p.name for p in (rl / "step_000002").iterdir()} >= {"__0_0.distcp", "__1_0.distcp", "manifest.json"}
