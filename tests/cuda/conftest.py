"""GPU tests: skipped cleanly when no usable cuda backend is present."""
import os

from tests.device_skip import skip_folder_without_backend

# Deterministic cuBLAS (needed by tests that enable torch.use_deterministic_algorithms) must be
# configured before the first cuBLAS handle exists, i.e. before any test of the session runs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config, items):
    skip_folder_without_backend(items, "cuda", "cuda")
