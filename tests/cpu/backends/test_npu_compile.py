"""torch.compile on the NPU backend: the fused head's kernels compile through torchair's backend
when it imports (after torch_npu), else they run eager, decided once in the backend and logged
once. Stand-in torch_npu and torchair modules (backend_standins.py)."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
from tests.helpers.backend_standins import BrokenTorchNpuFinder, FakeNpuRuntime, torchair_standin, working_torch_npu

from polyfsdp.backends.npu import NPUBackend
from polyfsdp.engines.head import fused_compiled as flc
from polyfsdp.engines.config import ConfigFieldError


@pytest.fixture
def npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", working_torch_npu())
    monkeypatch.setattr(torch, "npu", FakeNpuRuntime(count=1), raising=False)
    # resolve_fused_kernel_impl selects the process-wide compiler: restore it after the test.
    monkeypatch.setattr(flc, "_compiler", "inductor")
    monkeypatch.setattr(flc, "_KERNELS", {})
    return NPUBackend()


def test_the_fused_head_compiles_through_torchairs_backend_when_it_imports(npu, monkeypatch):
    graphs: list[int] = []
    monkeypatch.setitem(sys.modules, "torchair", torchair_standin(graphs))
    assert npu.compile_unsupported() is None
    assert flc.resolve_fused_kernel_impl("auto", npu) == ("compiled", True)
    kernels = flc.compiled_kernels(fallback_to_eager=True)
    assert kernels.backend is npu.compile_backend()
    torch._dynamo.reset()
    y, labels = torch.randn(6, 9), torch.randint(0, 9, (6,))
    got = kernels.forward_stats(y, labels, True)
    assert graphs, "the kernel did not go through torchair's backend"
    for a, b in zip(got, flc._forward_stats_entropy(y, labels)):
        torch.testing.assert_close(a, b)


def test_without_torchair_the_kernels_run_eager_and_the_decision_is_logged_once(npu, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torchair", None)  # import torchair raises ImportError
    caplog.set_level(logging.INFO, logger="polyfsdp.backends.npu")
    reason = npu.compile_unsupported()
    assert "torchair" in reason and "install torchair" in reason
    assert flc.resolve_fused_kernel_impl("auto", npu) == ("eager", False)
    assert flc.resolve_fused_kernel_impl("auto", npu) == ("eager", False)
    with pytest.raises(ConfigFieldError, match="'compiled' is not available: torch.compile on NPU goes through "
                                               "torchair's backend"):
        flc.resolve_fused_kernel_impl("compiled", npu)
    decisions = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(decisions) == 1 and "run eager" in decisions[0].getMessage()
    assert flc._compiler == "inductor"  # nothing compiled, nothing selected


def test_without_a_loadable_torch_npu_there_is_no_compiler(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenTorchNpuFinder(), *sys.meta_path])
    reason = NPUBackend().compile_unsupported()
    assert reason.startswith("torch.compile on NPU needs torch_npu: torch_npu is installed but failed to load")
