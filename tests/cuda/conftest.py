"""GPU tests: skipped cleanly when no usable CUDA backend is present."""
import pytest

from polyfsdp.backends import get_backend, BackendUnavailableError


def _cuda_reason():
    try:
        get_backend("cuda")
    except BackendUnavailableError as exc:
        return str(exc)
    return None


_REASON = _cuda_reason()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=_REASON)
    for item in items:
        if "/tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
