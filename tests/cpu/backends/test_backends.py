"""Backend selection, explicit-vs-auto failures, CPU calls, and NPU diagnosis via stand-ins."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT
import polyfsdp.backends as backends
from tests.helpers.backend_standins import CANN_ERROR, BrokenTorchNpuFinder, FakeNpuRuntime, working_torch_npu
from tests.helpers.backend_standins import fresh_registry  # noqa: F401  (autouse fixture)


@pytest.fixture
def broken_torch_npu(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenTorchNpuFinder(), *sys.meta_path])


@pytest.fixture
def fake_npu(monkeypatch):
    runtime = FakeNpuRuntime(count=2)
    monkeypatch.setitem(sys.modules, "torch_npu", working_torch_npu())
    monkeypatch.setattr(torch, "npu", runtime, raising=False)
    return runtime


def test_auto_selects_cpu_on_a_cpu_only_host():
    assert backends.get_backend().name == "cpu"
    assert backends.get_backend("auto").name == "cpu"


def test_auto_order_prefers_npu_then_cuda_then_cpu():
    assert backends.AUTO_ORDER == ("npu", "cuda", "cpu")
    assert [s.name for s in backends.available_backends()] == ["npu", "cuda", "cpu"]


def test_auto_picks_npu_when_torch_npu_loads_and_a_device_is_present(fake_npu):
    backend = backends.get_backend()
    assert backend.name == "npu"
    assert backend.dist_backend == "hccl"
    backend.set_device(1)
    backend.manual_seed(3)
    backend.synchronize()
    backend.set_rng_state(backend.get_rng_state())
    assert fake_npu.calls == [("set_device", 1), ("manual_seed_all", 3), ("synchronize",),
                              ("set_rng_state_all", ["npu rng state"])]
    assert "rms_norm" in backend.fused_ops()


def test_env_variable_overrides_auto(monkeypatch):
    monkeypatch.setenv(backends.ENV_OVERRIDE, "cpu")
    assert backends.get_backend().name == "cpu"
    monkeypatch.setenv(backends.ENV_OVERRIDE, "tpu")
    with pytest.raises(ValueError, match="POLYFSDP_BACKEND.*'tpu'.*auto, cpu, cuda, npu"):
        backends.get_backend()


def test_env_variable_does_not_override_an_explicit_name(monkeypatch):
    monkeypatch.setenv(backends.ENV_OVERRIDE, "npu")
    assert backends.get_backend("cpu").name == "cpu"


def test_unknown_backend_name_is_rejected_with_choices():
    with pytest.raises(ValueError, match="unknown backend 'gpu'; choose one of auto, cpu, cuda, npu"):
        backends.get_backend("gpu")


def test_explicit_cuda_without_gpu_raises_with_reason():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(backends.BackendUnavailableError, match="backend 'cuda' is not usable: .*"):
        backends.get_backend("cuda")


def test_broken_torch_npu_is_diagnosed_in_plain_words(broken_torch_npu):
    status = {s.name: s for s in backends.available_backends()}["npu"]
    assert not status.available
    assert status.reason.startswith("torch_npu is installed but failed to load: ")
    assert CANN_ERROR in status.reason and "CANN toolkit" in status.reason and "set_env.sh" in status.reason


def test_explicit_npu_request_with_broken_torch_npu_raises(broken_torch_npu):
    with pytest.raises(backends.BackendUnavailableError, match="libhccl.so.*install the CANN toolkit"):
        backends.get_backend("npu")


def test_auto_falls_back_quietly_and_logs_the_reason_once(broken_torch_npu, caplog):
    caplog.set_level("INFO", logger="polyfsdp.backends.registry")
    assert backends.get_backend().name == "cpu"
    assert backends.get_backend().name == "cpu"
    npu_lines = [r for r in caplog.records if "skipped npu" in r.getMessage()]
    assert len(npu_lines) == 1 and "libhccl.so" in npu_lines[0].getMessage()


def test_torch_npu_version_mismatch_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", working_torch_npu(version="2.1.0"))
    reason = {s.name: s for s in backends.available_backends()}["npu"].reason
    assert "does not match torch" in reason and "2.1.0" in reason


def test_cpu_backend_calls_never_crash():
    cpu = backends.get_backend("cpu")
    assert (cpu.name, cpu.device_type, cpu.dist_backend) == ("cpu", "cpu", "gloo")
    assert cpu.device(3) == torch.device("cpu")
    cpu.set_device(0)
    cpu.synchronize()
    assert cpu.get_rng_state() == {}
    cpu.set_rng_state({})
    assert cpu.fused_ops() == {}
    assert isinstance(cpu.default_attn_implementation, str)


def test_cpu_manual_seed_makes_draws_repeatable():
    cpu = backends.get_backend("cpu")
    cpu.manual_seed(7)
    first = torch.rand(4)
    cpu.manual_seed(7)
    assert torch.equal(first, torch.rand(4))


def _run_report(env_extra: dict, python_path_prefix: str | None = None):
    import os

    env = {k: v for k, v in os.environ.items() if k != backends.ENV_OVERRIDE}
    env.update(env_extra)
    code = (
        "import sys\n"
        + (f"sys.path.insert(0, {python_path_prefix!r})\n" if python_path_prefix else "")
        + "from tests.helpers.backend_standins import BrokenTorchNpuFinder\n"
        "sys.meta_path.insert(0, BrokenTorchNpuFinder())\n"
        "import runpy\n"
        "runpy.run_module('polyfsdp.backends', run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_report_exits_nonzero_with_cann_message_when_npu_is_forced():

    result = _run_report({backends.ENV_OVERRIDE: "npu"}, str(ROOT))
    assert result.returncode == 1
    assert "libhccl.so" in result.stderr and "CANN toolkit" in result.stderr
    assert "backend" in result.stdout and "cpu" in result.stdout


def test_report_prints_table_and_selection_by_default():

    result = _run_report({}, str(ROOT))
    assert result.returncode == 0, result.stderr
    for name in ("npu", "cuda", "cpu", "torch ", "transformers ", "selected: cpu"):
        assert name in result.stdout


def test_importing_polyfsdp_with_broken_torch_npu_works():

    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.helpers.backend_standins import BrokenTorchNpuFinder\n"
        "sys.meta_path.insert(0, BrokenTorchNpuFinder())\n"
        "import polyfsdp.backends, polyfsdp.engines, polyfsdp.patches\n"
        "assert 'torch_npu' not in sys.modules\n"
        "print(polyfsdp.backends.get_backend().name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu"


def _install_broken_torch_npu_distribution(root) -> None:
    """A torch_npu distribution that registers torch's device-extension entry point
    and fails to import the way a wheel without CANN does."""
    package = root / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise ImportError({CANN_ERROR!r})\n")
    dist_info = root / "torch_npu-2.13.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (dist_info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")


def test_report_survives_torchs_extension_autoload_of_a_broken_torch_npu(tmp_path):
    import os

    _install_broken_torch_npu_distribution(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in (backends.ENV_OVERRIDE, "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    bare = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env, timeout=120)
    assert bare.returncode != 0, "the stand-in distribution should break a bare `import torch`"
    env[backends.ENV_OVERRIDE] = "npu"
    result = subprocess.run([sys.executable, "-m", "polyfsdp.backends"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "torch_npu is installed but failed to load: libhccl.so" in result.stderr


def _installed_flash_attn():
    """A stand-in ``flash_attn`` that ``importlib.util.find_spec`` reports as installed."""
    import importlib.machinery
    import types

    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    return module


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, "flash_attention_2"), (torch.float16, "flash_attention_2"),
                                            (torch.float32, "polyfsdp_varlen_sdpa")])
def test_cuda_picks_flash_attention_only_for_half_precision_compute(monkeypatch, dtype, expected):
    from polyfsdp.backends.cuda import CUDABackend

    monkeypatch.setitem(sys.modules, "flash_attn", _installed_flash_attn())
    assert CUDABackend().attn_implementation(dtype) == expected


def test_cuda_without_flash_attn_uses_varlen_sdpa_in_every_dtype(monkeypatch):
    from polyfsdp.backends.cuda import CUDABackend

    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [])  # no finder: flash_attn is absent even where installed
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert CUDABackend().attn_implementation(dtype) == "polyfsdp_varlen_sdpa"
