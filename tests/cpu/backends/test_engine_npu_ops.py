"""The NPU engine checks (tests/npu/engine_checks.py) on the CPU: the NPU backend's op table filled
with the plain-torch reference ops (tests/npu/reference_ops.py), so every fused-op patch, the
packed TND attention path and their backward run inside FSDPEngine before hardware does.
Tolerances: fp32 1e-5 (the CPU mode matrix's bound), bf16 engine_reference.BF16_TOLERANCE."""
import pytest

from tests.helpers.engine_reference import BF16_TOLERANCE
from polyfsdp.backends.cpu import CPUBackend
from polyfsdp.backends.npu import NPUBackend
from tests.npu import reference_ops
from tests.npu.engine_checks import MODES, check_infer_every_mode, check_train_step


class _CPUWithNpuReferenceOps(CPUBackend):
    """The CPU device, with the NPU backend's attention choice, fused-op table (reference ops) and
    op limits, counting the calls of each op (so a test can tell the patched ops really ran)."""

    default_attn_implementation = NPUBackend.default_attn_implementation

    def __init__(self):
        self.calls = {}

    def fused_ops(self):
        def counted(name, op):
            def call(*args, **kwargs):
                self.calls[name] = self.calls.get(name, 0) + 1
                return op(*args, **kwargs)
            return call
        return {name: counted(name, op) for name, op in NPUBackend().fused_ops().items()}

    def fused_op_unsupported(self, op, facts):
        return NPUBackend().fused_op_unsupported(op, facts)


@pytest.fixture
def npu_ops_on_cpu():
    with reference_ops.installed_reference_torch_npu():
        yield _CPUWithNpuReferenceOps()


@pytest.mark.parametrize("preset", ["qwen2-tiny-tied", "llama-tiny"])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_engine_with_reference_npu_ops_matches_reference_in_every_mode(npu_ops_on_cpu, preset, param_dtype):
    tols = {k: 1e-5 for k in ("log_probs", "entropy")} if param_dtype == "float32" else BF16_TOLERANCE[preset]
    check_infer_every_mode(npu_ops_on_cpu, preset, param_dtype, tols)
    assert set(npu_ops_on_cpu.calls) == {"rms_norm", "rotary_mul", "swiglu", "fusion_attention"}


@pytest.mark.parametrize("rmpad,fused,pad_mode", MODES)
def test_train_step_through_reference_npu_ops_matches_reference_step(npu_ops_on_cpu, rmpad, fused, pad_mode):
    check_train_step(npu_ops_on_cpu, rmpad, fused, pad_mode, loss_rel_tol=1e-5, grad_tol=1e-7)
    assert set(npu_ops_on_cpu.calls) == {"rms_norm", "rotary_mul", "swiglu", "fusion_attention"}
