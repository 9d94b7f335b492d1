import os
import sys

import pytest
import torch

# Test helpers in this folder (stand-ins, references) import by bare module name.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _restore_threads():
    # polyfsdp-train's main() applies trainer.cpu_threads to this process; later tests expect the default.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
