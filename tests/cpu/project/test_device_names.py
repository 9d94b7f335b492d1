"""Only backends/ (and tests) may name a device, a device runtime or a collective library."""
from __future__ import annotations

import re

from tests.helpers import ROOT

CHECKED_FOLDERS = ("engines", "patches", "trainer", "configs", "benchmarks")
# A comparison with "cpu" is a device decision too: ask the backend (memory_is_host, ...).
FORBIDDEN = re.compile(r"\b(cuda|npu|nccl|hccl)\b|torch\.cuda|torch_npu"
                       r"""|(==|!=)\s*["']cpu["']|["']cpu["']\s*(==|!=)""")


def _violations() -> list[str]:
    found = []
    for folder in CHECKED_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if FORBIDDEN.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_pattern_catches_device_names():
    for text in ('x.to("cuda")', "import torch_npu", "torch.cuda.synchronize()", "backend='hccl'", "npu",
                 'device.type != "cpu"', "backend == 'cpu'", '"cpu" == name'):
        assert FORBIDDEN.search(text), text
    for text in ("accelerator", "cudagraph_free", "CPU", 'torch.device("cpu")', 'map_location="cpu"'):
        assert not FORBIDDEN.search(text), text


def test_no_file_outside_backends_names_a_device():
    assert (ROOT / "backends").is_dir() and (ROOT / "engines").is_dir()
    violations = _violations()
    assert not violations, "device names outside backends/:\n" + "\n".join(violations)
