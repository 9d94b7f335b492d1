"""GPU tests: skipped cleanly when no usable cuda backend is present."""
from tests.device_skip import skip_folder_without_backend


def pytest_collection_modifyitems(config, items):
    skip_folder_without_backend(items, "cuda", "cuda")
