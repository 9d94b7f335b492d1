"""The Ascend NPU backend (torch_npu, HCCL). torch_npu is imported lazily, here only."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Callable, MutableMapping

import torch

from . import npu_limits, npu_versions
from .npu_op_splits import SPLITTERS
from .base import Backend, ModelFacts
from .hccl_settings import apply_hccl_settings

logger = logging.getLogger(__name__)

_CANN_HINT = "install the CANN toolkit and source set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)"

# polyfsdp op name -> torch_npu attribute; patches look ops up by the left-hand name.
_FUSED_OP_NAMES = npu_limits.OP_NAMES


class NPUBackend(Backend):
    """Huawei Ascend NPUs through torch_npu."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    # The attention patch swaps in npu_fusion_attention (TND for packed batches).
    default_attn_implementation = "sdpa"
    alloc_conf_variable = "PYTORCH_NPU_ALLOC_CONF"
    vllm_package = "vllm-ascend"
    server_devices_variable = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self) -> None:
        self._module = None
        self._load_error: str | None = None
        self._loaded = False
        self._compiler = None
        self._compile_problem: str | None = None
        self._compile_decided = False

    def _torch_npu(self):
        """Import torch_npu once; remember a failure as one line naming the fix."""
        if self._loaded:
            return self._module
        self._loaded = True
        self._load_error = self._load_problem()
        if self._load_error is None:
            self._module = sys.modules["torch_npu"]
        return self._module

    def _load_problem(self) -> str | None:
        """Why torch_npu cannot be used with this torch, or None once it is imported."""
        if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
            return f"torch_npu is not installed: {npu_versions.matching_versions(torch.__version__)}"
        installed = npu_versions.installed_torch_npu()
        # A mismatched pair is diagnosed before the import, which would fail on undefined symbols
        # (an already imported module says its own version below).
        problem = (npu_versions.mismatch(torch.__version__, installed)
                   if installed and "torch_npu" not in sys.modules else None)
        if problem is not None:
            return problem
        try:
            module = importlib.import_module("torch_npu")
        except Exception as exc:  # a broken install raises ImportError/OSError/RuntimeError
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "undefined symbol" in message:
                return npu_versions.undefined_symbol(message, torch.__version__, installed)
            if ".so" in message or "CANN" in message or "libascend" in message or "libhccl" in message:
                return f"torch_npu is installed but failed to load: {message} — {_CANN_HINT}"
            return f"torch_npu is installed but failed to load: {type(exc).__name__}: {message}"
        npu_version = getattr(module, "__version__", None)
        return npu_versions.mismatch(torch.__version__, npu_version) if npu_version is not None else None

    def availability(self) -> str | None:
        module = self._torch_npu()
        if module is None:
            return self._load_error
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return "torch_npu loaded but no NPU is visible (check the driver and ASCEND_RT_VISIBLE_DEVICES)"
        return None

    def _device_module(self):
        # torch.npu exists only once torch_npu has been imported.
        self._torch_npu()
        return super()._device_module()

    # Even through torchair a graph may hold an op its compiler lacks: try it, eager on failure.
    compile_may_fail = True

    def _decide_compiler(self) -> None:
        """Pick torch.compile's backend once, and log the decision once: torchair's NPU backend
        (Ascend's supported route; their API tables do not list inductor for NPU), else none."""
        if self._compile_decided:
            return
        self._compile_decided = True
        if self._torch_npu() is None:
            self._compile_problem = f"torch.compile on NPU needs torch_npu: {self._load_error}"
        else:
            try:
                # torchair must be imported after torch_npu (Ascend's TorchAir-GE backend page:
                # docs/zh/user_guide/torch_compile/compilation_backend/torchair_ge_backend.md).
                torchair = importlib.import_module("torchair")
                self._compiler = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
            except Exception as exc:  # absent, or present but broken (CANN's graph engine missing)
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self._compile_problem = (f"torch.compile on NPU goes through torchair's backend, which is not "
                                         f"usable ({detail}); install torchair (it ships with torch_npu)")
        if self._compile_problem is None:
            logger.info("npu: torch.compile uses torchair's NPU backend")
        else:
            logger.info("npu: %s; compiled kernels run eager", self._compile_problem)

    def rollout_sleep_level(self, lora: bool) -> int | None:
        return 1  # vllm-ascend offers level-1 sleep only

    def compile_unsupported(self) -> str | None:
        self._decide_compiler()
        return self._compile_problem

    def compile_backend(self):
        self._decide_compiler()
        return self._compiler

    def fused_ops(self) -> dict[str, Callable]:
        module = self._torch_npu()
        if module is None:
            return {}
        ops = {op: getattr(module, attr) for op, attr in _FUSED_OP_NAMES.items() if hasattr(module, attr)}
        # Batch-dependent limits no config check can rule out: split such calls (npu_op_splits.py).
        return {op: SPLITTERS[op](fn) if op in SPLITTERS else fn for op, fn in ops.items()}

    def fused_op_unsupported(self, op: str, facts: ModelFacts) -> str | None:
        # The limits a model's config decides, from Ascend's op pages (backends/npu_limits.py).
        return npu_limits.model_problem(op, facts)

    def prepare_process_group(self, environ: MutableMapping[str, str]) -> tuple[float, str | None]:
        # HCCL reads its timeouts from the environment when the communicator is built.
        return apply_hccl_settings(environ)
