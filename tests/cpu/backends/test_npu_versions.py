"""The torch / torch_npu / CANN version matrix: a mismatched pair is one line naming both
versions and the matching install, found before the import (which would fail on undefined
symbols); an undefined-symbol import failure maps to the same kind of line; the report prints
torch, torch_npu and CANN versions. Import failures are stand-ins (backend_standins.py)."""
from __future__ import annotations

import sys

import pytest
import torch
from tests.helpers.backend_standins import UNDEFINED_SYMBOL_ERROR, BrokenTorchNpuFinder
from tests.helpers.backend_standins import fresh_registry  # noqa: F401  (autouse fixture)

import polyfsdp.backends as backends
from polyfsdp.backends import __main__ as report_module
from polyfsdp.backends import npu_versions
from polyfsdp.backends.npu import NPUBackend


@pytest.fixture
def importing_fails(monkeypatch):
    """torch_npu looks installed; importing it fails with the message the test installs."""
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    finders = list(sys.meta_path)

    def install(message: str):
        monkeypatch.setattr(sys, "meta_path", [BrokenTorchNpuFinder(message), *finders])
    return install


def test_a_mismatched_distribution_is_diagnosed_without_importing_it(monkeypatch, importing_fails):
    # The import would fail too; the version check must come first and say why in one line.
    importing_fails(UNDEFINED_SYMBOL_ERROR)
    monkeypatch.setattr(npu_versions, "installed_torch_npu", lambda: "2.1.0.post10")
    reason = NPUBackend().availability()
    assert reason == (f"torch_npu 2.1.0.post10 does not match torch {torch.__version__}: pip install "
                      f"torch_npu=={npu_versions.release(torch.__version__)} (its CANN: "
                      f"{npu_versions.COMPATIBILITY_PAGE}) or install the torch that matches torch_npu (torch==2.1.0)")
    with pytest.raises(backends.BackendUnavailableError, match="^backend 'npu' is not usable: torch_npu 2.1.0.post10 "
                                                               "does not match torch"):
        backends.get_backend("npu")


def test_an_undefined_symbol_at_import_names_the_matching_pair(monkeypatch, importing_fails, tmp_path):
    importing_fails(UNDEFINED_SYMBOL_ERROR)
    release = npu_versions.release(torch.__version__)
    monkeypatch.setattr(npu_versions, "installed_torch_npu", lambda: release)  # same release, other build
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    (tmp_path / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.5.0\n")
    reason = NPUBackend().availability()
    assert reason.startswith(f"torch_npu {release} was built for another torch than torch {torch.__version__} "
                             f"(undefined symbol _ZN3c1021throwNullDataPtrErrorEv), CANN 8.5.0: reinstall the "
                             f"matching pair, pip install torch=={release} and torch_npu=={release}")
    assert "\n" not in reason


def test_the_matrix_names_ascends_package_and_cann_for_a_known_torch():
    assert npu_versions.matching_versions("2.12.0+cpu") == (
        f"pip install torch_npu==2.12.0 (with CANN 9.1.0; {npu_versions.COMPATIBILITY_PAGE})")
    assert npu_versions.matching_versions("2.10.0") .startswith("pip install torch_npu==2.10.0.post4 (with CANN 9.1.0")
    assert npu_versions.mismatch("2.10.0+cpu", "2.10.0.post4") is None


def test_cann_version_comes_from_the_toolkit_install_record(monkeypatch, tmp_path):
    arch_dir = tmp_path / f"{npu_versions.platform.machine()}-linux"
    arch_dir.mkdir()
    (arch_dir / "ascend_toolkit_install.info").write_text("version=9.1.0\narch=x\n")
    assert npu_versions.cann_version({"ASCEND_HOME_PATH": str(tmp_path)}) == "9.1.0"
    monkeypatch.setattr(npu_versions, "_CANN_DEFAULT_HOMES", ())
    assert npu_versions.cann_version({}) is None


def test_the_report_prints_torch_torch_npu_and_cann_versions(monkeypatch, importing_fails):
    importing_fails(UNDEFINED_SYMBOL_ERROR)
    monkeypatch.setattr(npu_versions, "installed_torch_npu", lambda: "2.9.0.post6")
    monkeypatch.setattr(npu_versions, "cann_version", lambda environ=None: "9.1.0")
    text = report_module.report()
    assert f"torch {torch.__version__} | torch_npu 2.9.0.post6 | CANN 9.1.0 | transformers " in text
    assert "torch_npu 2.9.0.post6 does not match torch" in text
    assert f"torch_npu for this torch: pip install torch_npu=={npu_versions.release(torch.__version__)}" in text
