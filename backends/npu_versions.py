"""Which torch_npu and CANN go with this torch, what is installed, and the one line that says so.

torch_npu is built against one torch release and one CANN; a mismatch fails at import, often as
an ``undefined symbol`` from ``libtorch_npu.so``. The pairs below are Ascend's
(https://gitcode.com/Ascend/pytorch/blob/master/COMPATIBILITY.md, "TorchNPU version mapping
table": the newest package per torch release; polyfsdp needs torch >= 2.6).
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from typing import Mapping

COMPATIBILITY_PAGE = "https://gitcode.com/Ascend/pytorch/blob/master/COMPATIBILITY.md"
# torch release -> (torch_npu package, CANN).
MATRIX = {
    "2.12.0": ("2.12.0", "9.1.0"),
    "2.11.0": ("2.11.0", "9.1.0"),
    "2.10.0": ("2.10.0.post4", "9.1.0"),
    "2.9.0": ("2.9.0.post6", "9.1.0"),
    "2.8.0": ("2.8.0.post4", "9.0.0"),
    "2.7.1": ("2.7.1.post8", "9.1.0"),
    "2.6.0": ("2.6.0.post5", "8.5.0"),
}
# Where CANN's toolkit records its version ("version=..." in ascend_toolkit_install.info, under
# <arch>-linux/): the variables set_env.sh exports, then the default install paths.
_CANN_HOME_VARIABLES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
_CANN_DEFAULT_HOMES = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")


def release(version: str) -> str:
    """'2.13.0+cpu' or '2.13.0.post1' -> '2.13.0'; torch_npu must match torch at this level."""
    match = re.match(r"\d+\.\d+\.\d+", version)
    return match.group(0) if match else version


def installed_torch_npu() -> str | None:
    """The installed torch_npu distribution's version, without importing it (None: not installed)."""
    for name in ("torch_npu", "torch-npu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cann_version(environ: Mapping[str, str] = os.environ) -> str | None:
    """The CANN toolkit's version from its install record, or None when none is found."""
    homes = [environ[v] for v in _CANN_HOME_VARIABLES if environ.get(v)] + list(_CANN_DEFAULT_HOMES)
    arch = f"{platform.machine()}-linux"
    for home in homes:
        for path in (os.path.join(home, arch, "ascend_toolkit_install.info"),
                     os.path.join(home, "ascend_toolkit_install.info")):
            try:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    for line in handle:
                        key, _, value = line.strip().partition("=")
                        if key == "version" and value:
                            return value
            except OSError:
                continue
    return None


def matching_versions(torch_version: str) -> str:
    """The torch_npu (and CANN) that go with this torch, as an install instruction."""
    torch_release = release(torch_version)
    if torch_release in MATRIX:
        package, cann = MATRIX[torch_release]
        return f"pip install torch_npu=={package} (with CANN {cann}; {COMPATIBILITY_PAGE})"
    return f"pip install torch_npu=={torch_release} (its CANN: {COMPATIBILITY_PAGE})"


def mismatch(torch_version: str, npu_version: str) -> str | None:
    """One line when this torch_npu cannot work with this torch, else None."""
    if release(npu_version) == release(torch_version):
        return None
    return (f"torch_npu {npu_version} does not match torch {torch_version}: {matching_versions(torch_version)}"
            f" or install the torch that matches torch_npu (torch=={release(npu_version)})")


def undefined_symbol(message: str, torch_version: str, npu_version: str | None) -> str:
    """The line for a torch_npu whose import fails with an undefined symbol: it was built for
    another torch build (or another CANN) than the one installed."""
    symbol = re.search(r"undefined symbol: (\S+)", message)
    found = f" (undefined symbol {symbol.group(1)})" if symbol else ""
    cann = cann_version()
    return (f"torch_npu {npu_version or '(unknown version)'} was built for another torch than torch {torch_version}"
            f"{found}, CANN {cann or 'not found'}: reinstall the matching pair, pip install "
            f"torch=={release(torch_version)} and {matching_versions(torch_version).removeprefix('pip install ')}")
