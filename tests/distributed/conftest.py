import os
import sys

# Shared launcher helpers in this folder import by bare module name.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from tests.device_skip import missing_devices_reason  # noqa: E402

WORLD = 2
DIST_BACKENDS = ("cpu", "cuda", "npu")


@pytest.fixture(scope="module", params=DIST_BACKENDS)
def dist_backend(request):
    """The backend a multi-rank test runs on: cpu always (gloo); cuda (nccl) and npu (hccl) when
    this host has WORLD devices of that kind, else the test is skipped with the reason."""
    reason = missing_devices_reason(request.param, WORLD)
    if reason is not None:
        pytest.skip(reason)
    return request.param
