"""NPU tests: skipped cleanly when no usable CUDA backend is present."""
import pytest

from polyfsdp.backends import get_backend, BackendUnavailableError


def _npu_reason():
    try:
        get_backend("npu")
    except BackendUnavailableError as exc:
        return str(exc)
    return None


_REASON = _npu_reason()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=_REASON)
    for item in items:
        if "/tests/npu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
