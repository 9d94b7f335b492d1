"""The README's quick-start result is what the quick start prints: the default job
(``polyfsdp-train`` with no overrides but an output directory) runs here, and its last line must
be the one the README shows under "The main job". A change of defaults or numerics that moves it
fails this test until the README is re-measured. The job is deterministic at a fixed seed on
one machine; another CPU model (other SIMD kernels, another float summation order) can change a
few greedy answers of the 128, so each number must be within ``CPU_SPREAD`` of the README's."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"held-out mean reward: initial (\d\.\d{3}) -> after_sft (\d\.\d{3}) -> final (\d\.\d{3})")
CPU_SPREAD = 0.02  # about 2.5 of the 128 held-out prompts; the drift a code change causes is larger


def readme_result() -> str:
    """The first result line the README shows: the one under "The main job"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The main job", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```text\n(.*?)\n```", section, flags=re.S)
    assert match and RESULT.fullmatch(match.group(1).strip()), "the README's main job shows no result line"
    return match.group(1).strip()


def test_the_default_job_prints_the_readmes_result(tmp_path):
    done = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", f"trainer.output_dir={tmp_path / 'run'}",
                           "trainer.progress=off"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.strip().splitlines()[-1]
    assert RESULT.fullmatch(printed), printed
    shown = readme_result()
    got = [float(x) for x in RESULT.fullmatch(printed).groups()]
    want = [float(x) for x in RESULT.fullmatch(shown).groups()]
    assert all(abs(g - w) <= CPU_SPREAD for g, w in zip(got, want)), \
        f"the default job printed {printed!r}, the README shows {shown!r}; update the README (or find the drift)"
