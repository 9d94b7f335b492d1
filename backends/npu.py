"""The Ascend NPU backend (torch_npu, HCCL). torch_npu is imported lazily, here only."""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from typing import Callable

import torch

from .base import Backend

_CANN_HINT = "install the CANN toolkit and source set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)"

# polyfsdp op name -> torch_npu attribute; patches look ops up by the left-hand name.
_FUSED_OP_NAMES = {
    "rms_norm": "npu_rms_norm",
    "rotary_mul": "npu_rotary_mul",
    "swiglu": "npu_swiglu",
    "fusion_attention": "npu_fusion_attention",
}


def _release(version: str) -> str:
    """'2.13.0+cpu' or '2.13.0.post1' -> '2.13.0'; torch_npu must match torch at this level."""
    match = re.match(r"\d+\.\d+\.\d+", version)
    return match.group(0) if match else version


class NPUBackend(Backend):
    """Huawei Ascend NPUs through torch_npu."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    # The attention patch swaps in npu_fusion_attention (TND for packed batches).
    default_attn_implementation = "sdpa"
    vllm_package = "vllm-ascend"

    def __init__(self) -> None:
        self._module = None
        self._load_error: str | None = None
        self._loaded = False

    def _torch_npu(self):
        """Import torch_npu once; remember a failure as a plain-words reason."""
        if self._loaded:
            return self._module
        self._loaded = True
        if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
            self._load_error = (
                f"torch_npu is not installed (pip install torch_npu=={_release(torch.__version__)})"
            )
            return None
        try:
            module = importlib.import_module("torch_npu")
        except Exception as exc:  # a broken install raises ImportError/OSError/RuntimeError
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if ".so" in message or "CANN" in message or "libascend" in message or "libhccl" in message:
                self._load_error = f"torch_npu is installed but failed to load: {message} — {_CANN_HINT}"
            else:
                self._load_error = f"torch_npu is installed but failed to load: {type(exc).__name__}: {message}"
            return None
        npu_version = getattr(module, "__version__", None)
        if npu_version is not None and _release(npu_version) != _release(torch.__version__):
            self._load_error = (
                f"torch_npu {npu_version} does not match torch {torch.__version__}: "
                f"install torch_npu=={_release(torch.__version__)}"
            )
            return None
        self._module = module
        return module

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

    # torch_npu's inductor support depends on its version and the CANN toolchain: try it.
    compile_may_fail = True

    def rollout_sleep_level(self, lora: bool) -> int | None:
        return 1  # vllm-ascend offers level-1 sleep only

    def compile_unsupported(self) -> str | None:
        return None

    def fused_ops(self) -> dict[str, Callable]:
        module = self._torch_npu()
        if module is None:
            return {}
        return {op: getattr(module, attr) for op, attr in _FUSED_OP_NAMES.items() if hasattr(module, attr)}
