"""The collective helpers on two torchrun processes (gloo): sum, max, gather, broadcast, barrier."""
import os

from torchrun_launcher import run_torchrun

HERE = os.path.dirname(__file__)


def test_collective_helpers_combine_two_ranks():
    result = run_torchrun(os.path.join(HERE, "worker_collectives.py"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank="))
    tail = "sum=[3.0, 10.0] max=[1, 5] gathered=['r0', 'r1'] broadcast=from1"
    assert lines == [f"rank=0 {tail}", f"rank=1 {tail}"]
