"""The README's Python example runs as written, and the config keys it names exist."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_engine_example_runs():
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 1, "expected exactly one python example in the README"
    result = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300,
                            env={"POLYFSDP_BACKEND": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    for key in ("'loss'", "'grad_norm'", "'step_skipped'", "'clip_frac'"):
        assert key in result.stdout


def test_readme_patch_keys_exist_in_the_patches_config():
    readme = (ROOT / "README.md").read_text()
    config = (ROOT / "configs" / "patches" / "default.yaml").read_text()
    for key in set(re.findall(r"`patches\.(\w+)", readme)):
        assert re.search(rf"^{key}:", config, flags=re.M), key
