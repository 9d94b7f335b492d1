"""The engine asks the backend for its attention with the COMPUTE dtype (EngineConfig.param_dtype),
not the weights' dtype: fp32 weights computing in bf16 may use flash attention, fp32 compute may not."""
import pytest
import torch

from polyfsdp.backends.cpu import CPUBackend
from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine


class _RecordingBackend(CPUBackend):
    """The CPU backend, answering 'sdpa' for bf16 compute and 'eager' otherwise, and recording the question."""

    def __init__(self):
        self.asked: list[torch.dtype] = []

    def attn_implementation(self, compute_dtype):
        self.asked.append(compute_dtype)
        return "sdpa" if compute_dtype == torch.bfloat16 else "eager"


@pytest.mark.parametrize("param_dtype,expected", [("bfloat16", "sdpa"), ("float32", "eager")])
def test_engine_chooses_attention_by_param_dtype_not_weight_dtype(param_dtype, expected):
    backend = _RecordingBackend()
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", dtype="float32"), EngineConfig(param_dtype=param_dtype),
                        backend=backend).initialize()
    assert backend.asked == [getattr(torch, param_dtype)]
    assert engine.module.config._attn_implementation == expected


def test_explicit_attn_implementation_is_not_overridden_by_the_backend():
    backend = _RecordingBackend()
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", attn_implementation="eager"),
                        EngineConfig(param_dtype="bfloat16"), backend=backend).initialize()
    assert backend.asked == [] and engine.module.config._attn_implementation == "eager"
