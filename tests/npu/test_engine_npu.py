"""FSDPEngine on an Ascend NPU (skipped elsewhere by conftest): every mode with every fused-op patch
(npu_fusion_attention TND/BSND, npu_rotary_mul, npu_rms_norm, npu_swiglu) and the fused head, bf16
and fp32 inference and an fp32 training step through the ops' backward, against the plain-HF
reference. tests/cpu/backends/test_engine_npu_ops.py runs the same checks on the CPU with the reference ops.

Tolerances: not yet measured on hardware. fp32 1e-4 (as test_patches_npu.py; the CPU twin holds
1e-5); bf16 engine_reference.BF16_TOLERANCE (3x the CPU bf16 error; fused NPU kernels may round
differently, and a failure here reports the measured error). Two ranks over HCCL:
tests/distributed (parametrized by backend)."""
import pytest

from polyfsdp.backends import get_backend
from tests.npu.engine_checks import MODES, check_infer_every_mode, check_train_step
from tests.helpers.engine_reference import BF16_TOLERANCE  # noqa: E402

FP32_TOL = 1e-4


@pytest.mark.parametrize("preset", sorted(BF16_TOLERANCE))
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_npu_infer_batch_matches_reference_in_every_mode(preset, param_dtype):
    tols = {k: FP32_TOL for k in ("log_probs", "entropy")} if param_dtype == "float32" else BF16_TOLERANCE[preset]
    check_infer_every_mode(get_backend("npu"), preset, param_dtype, tols)


@pytest.mark.parametrize("rmpad,fused,pad_mode", MODES)
def test_npu_train_step_matches_reference_step(rmpad, fused, pad_mode):
    check_train_step(get_backend("npu"), rmpad, fused, pad_mode, loss_rel_tol=1e-4, grad_tol=1e-5)
