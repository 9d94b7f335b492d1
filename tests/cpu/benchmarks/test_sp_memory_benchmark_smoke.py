"""The sequence-parallel memory benchmark runs end to end (--quick) and prints its ratio table."""
import os
import sys

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_sp_memory_benchmark_quick_prints_both_settings(capsys):
    import sp_memory

    res = sp_memory.main(["--quick", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "sp=1 (dp=2)" in out and "sp=2 (one SP group)" in out and "ratio to sp=1" in out
    assert all(len(res["peaks"][sp]) == 1 for sp in (1, 2))
