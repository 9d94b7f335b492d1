"""benchmarks/rewrap.py runs end to end and prints its side-by-side table."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import ROOT



def test_rewrap_benchmark_quick_prints_a_table_with_every_method():
    env = dict(os.environ, POLYFSDP_BACKEND="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rewrap.py"), "--quick", "--rounds", "1"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("shape"))
    for column in ("mask", "narrow+cat", "aten", "ours", "floor", "ours fastest?"):
        assert column in header
    rows = [line for line in lines if line.startswith("(")]
    assert len(rows) == 2
    assert all(line.count("x)") == 5 for line in rows)
