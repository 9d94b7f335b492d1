"""Stand-in torch_npu modules for exercising the NPU backend without Ascend hardware."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import types

import pytest
import torch

from polyfsdp.backends import ENV_OVERRIDE, registry
from polyfsdp.backends.cpu import CPUBackend

@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Every backend created anew for the test and no POLYFSDP_BACKEND (import it to use it)."""
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    registry._reset_cache()
    yield
    registry._reset_cache()


CANN_ERROR = "libhccl.so: cannot open shared object file: No such file or directory"


# What importing a torch_npu built for another torch raises (the symbol is one of c10's).
UNDEFINED_SYMBOL_ERROR = ("/usr/lib/python3/site-packages/torch_npu/lib/libtorch_npu.so: undefined symbol: "
                          "_ZN3c1021throwNullDataPtrErrorEv")


class _BrokenLoader(importlib.abc.Loader):
    """Raises the ImportError a broken torch_npu install raises (by default: CANN missing)."""

    def __init__(self, message: str):
        self.message = message

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(self.message)


class BrokenTorchNpuFinder(importlib.abc.MetaPathFinder):
    """Makes ``torch_npu`` look installed, but fail on import like a CANN-less install (or with
    ``message``, e.g. UNDEFINED_SYMBOL_ERROR)."""

    def __init__(self, message: str = CANN_ERROR):
        self.message = message

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch_npu":
            return importlib.machinery.ModuleSpec("torch_npu", _BrokenLoader(self.message))
        return None


class FakeNpuRuntime(types.SimpleNamespace):
    """What ``torch.npu`` offers once torch_npu is loaded, minus real devices."""

    def __init__(self, count: int = 2):
        super().__init__()
        self.count = count
        self.calls: list[tuple] = []

    def is_available(self):
        return self.count > 0

    def set_device(self, index):
        self.calls.append(("set_device", index))

    def manual_seed_all(self, seed):
        self.calls.append(("manual_seed_all", seed))

    def synchronize(self):
        self.calls.append(("synchronize",))

    def get_rng_state_all(self):
        return ["npu rng state"]

    def set_rng_state_all(self, states):
        self.calls.append(("set_rng_state_all", states))


def working_torch_npu(version: str | None = None) -> types.ModuleType:
    """A module object standing in for an importable torch_npu of the given version."""
    module = types.ModuleType("torch_npu")
    module.__version__ = version or torch.__version__.split("+")[0] + ".post1"
    module.npu_rms_norm = lambda x, gamma, epsilon=1e-6: (x, x)
    return module


class HostMemoryAccelerator(CPUBackend):
    """The CPU backend declared as an accelerator whose memory is not host memory, so that
    engine.offload really moves work to the host (engines/parallel/offload.py) on a CPU-only machine."""

    name = "cpu-as-accelerator"
    memory_is_host = False


def torchair_standin(compiled_graphs: list) -> types.ModuleType:
    """A stand-in ``torchair``: ``get_npu_backend()`` returns a torch.compile backend that records
    each graph it is handed (its input count) and runs the graph as it is (eager)."""
    module = types.ModuleType("torchair")

    class CompilerConfig:
        pass

    def get_npu_backend(compiler_config=None):
        assert isinstance(compiler_config, CompilerConfig)

        def backend(graph_module, example_inputs):
            compiled_graphs.append(len(example_inputs))
            return graph_module.forward

        return backend

    module.CompilerConfig = CompilerConfig
    module.get_npu_backend = get_npu_backend
    return module
