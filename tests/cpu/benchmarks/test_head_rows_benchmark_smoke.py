"""benchmarks/head_rows.py runs (a smoke run: 2 layers, one round) and prints both passes."""
import re
import subprocess
import sys

from tests.helpers import ROOT



def test_the_head_rows_benchmark_prints_a_ratio_per_pass():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "head_rows.py"), "--quick", "--layers", "2",
                           "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("old-log-prob", "ppo-step"):
        assert re.search(rf"^{name}\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d$", done.stdout, flags=re.M), done.stdout
