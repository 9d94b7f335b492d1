"""scripts/validate_accelerator.sh parses, and on a host without an accelerator it stops at once with
a non-zero exit and says so in its report (it never reports a CPU run as an accelerator pass)."""
import os
import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "validate_accelerator.sh"


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_without_an_accelerator_the_script_fails_and_says_why(tmp_path):
    report = tmp_path / "report.md"
    env = {**os.environ, "PYTHON": sys.executable, "POLYFSDP_BACKEND": "cpu"}
    result = subprocess.run(["bash", str(SCRIPT), "--quick", str(report)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 1
    assert "no accelerator found (selected backend: cpu)" in report.read_text()
