"""The collective helpers on two torchrun processes, per backend (gloo always; nccl/hccl with two
devices): sum, max, gather, broadcast, barrier."""
import os

from torchrun_launcher import run_torchrun

from polyfsdp.backends import get_backend

HERE = os.path.dirname(__file__)


def test_collective_helpers_combine_two_ranks(dist_backend):
    result = run_torchrun(os.path.join(HERE, "worker_collectives.py"), nproc=2, backend=dist_backend)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank="))
    backend = get_backend(dist_backend)
    tail = (f"backend={backend.dist_backend} device={backend.device_type} "
            "sum=[3.0, 10.0] max=[1, 5] gathered=['r0', 'r1'] broadcast=from1")
    assert lines == [f"rank=0 {tail}", f"rank=1 {tail}"]
