"""The fused log-prob benchmark runs end to end on tiny shapes and prints its table."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_benchmark_quick_run_prints_every_path():
    script = os.path.join(ROOT, "benchmarks", "fused_logprob.py")
    done = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    paths = {row[0] for row in rows if len(row) >= 6 and row[1] == "fwd+bwd"}
    assert paths == {"floor", "naive", "fused"}, done.stdout
    assert "ERROR" not in done.stdout
