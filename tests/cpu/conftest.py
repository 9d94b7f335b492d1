import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_threads():
    # polyfsdp-train's main() applies trainer.cpu_threads to this process; later tests expect the default.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
