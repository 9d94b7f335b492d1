"""``python -m polyfsdp.backends``: which backends can run here, and why not."""
from __future__ import annotations

import importlib.metadata
import sys

import torch

from . import npu_versions
from .base import BackendUnavailableError
from .registry import ENV_OVERRIDE, available_backends, get_backend


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    """The backend table plus package versions, as text."""
    lines = [f"{'backend':<8} {'usable':<7} reason", f"{'-' * 8} {'-' * 7} {'-' * 40}"]
    for status in available_backends():
        lines.append(f"{status.name:<8} {'yes' if status.available else 'no':<7} {status.reason or ''}")
    lines.append("")
    npu = npu_versions.installed_torch_npu() or "not installed"
    cann = npu_versions.cann_version() or "not found"
    lines.append(f"torch {torch.__version__} | torch_npu {npu} | CANN {cann} | transformers {_version('transformers')}")
    lines.append(f"torch_npu for this torch: {npu_versions.matching_versions(torch.__version__)}")
    return "\n".join(lines)


def main() -> int:
    """Print the report and the selected backend; exit 1 if the selection fails."""
    print(report())
    try:
        backend = get_backend()
    except (BackendUnavailableError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"selected: {backend.name} (set {ENV_OVERRIDE} to override)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
