"""The long-prompt sequence-parallel job memory benchmark runs end to end (short prompts) and
prints both settings."""
import os
import sys

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_sp_job_memory_benchmark_prints_both_settings(capsys):
    import sp_job_memory

    res = sp_job_memory.main(["--prompt-len", "64"])
    out = capsys.readouterr().out
    assert "sp=1 (dp=2, 1 prompt / rank)" in out and "sp=2 (1 replica, 1 prompt)" in out
    assert all(len(res["peaks"][sp]) == 1 and res["peaks"][sp][0] > 0 for sp in (1, 2))
