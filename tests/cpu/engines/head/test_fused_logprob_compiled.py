"""The compiled chunk kernels (torch.compile): float64 gradcheck, compile counts, the entropy-free
path, backend declarations. Their float32 and low-precision comparisons with the float64
full-logits reference run beside the eager kernels' in test_fused_logprob.py (``impl``)."""
from __future__ import annotations

import logging

import pytest
import torch
from tests.cpu.engines.head.test_fused_logprob import make

from polyfsdp.backends.cpu import CPUBackend
from polyfsdp.engines.head import fused_compiled as flc
from polyfsdp.engines.config import ConfigFieldError, EngineConfig
from polyfsdp.engines.head.fused import fused_logprob_entropy


def compiled(hidden, weight, labels, **kwargs):
    return fused_logprob_entropy(hidden, weight, labels, impl="compiled", **kwargs)


def test_float64_gradcheck():
    n, h, v = 5, 3, 7
    hidden, weight, labels = make(n, h, v, torch.float64, seed=1)
    labels[2] = -100
    temperature = torch.linspace(0.5, 1.6, n, dtype=torch.float64)

    def fn(hh, ww):
        return compiled(hh, ww, labels, temperature=temperature, chunk_size=4, softcap=1.5)

    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_()))


def test_twenty_calls_with_varying_token_counts_compile_twice():
    # Dynamic shapes: one forward and one backward graph serve every token count (torch
    # specialises only sizes 0 and 1, which these counts avoid). Negative control below.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    weight = torch.randn(97, 16, requires_grad=True)
    for n in range(7, 7 + 20 * 5, 5):
        hidden, _, labels = make(n, 16, 97, seed=n)
        lp, ent = compiled(hidden.requires_grad_(), weight, labels)
        (lp.sum() + ent.sum()).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_static_shapes_would_recompile_per_token_count():
    # Negative control for the count above: the same counter sees one graph per N when the
    # shapes are static (CompileCounter: counts without building kernels).
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    fn = torch.compile(flc._forward_stats, dynamic=False, backend=counter)
    for n in (3, 4, 5, 6):
        fn(torch.randn(n, 11), torch.zeros(n, dtype=torch.long))
    assert counter.frame_count == 4


def test_entropy_free_path_runs_no_entropy_kernel(monkeypatch):
    called = []
    real_call = flc.CompiledChunkKernels._call

    def spy(self, fn, *args):
        called.append(fn.__name__)
        return real_call(self, fn, *args)

    monkeypatch.setattr(flc.CompiledChunkKernels, "_call", spy)
    hidden, weight, labels = make(10, 4, 13, seed=11)
    lp, ent = compiled(hidden.requires_grad_(), weight.requires_grad_(), labels, return_entropy=False, chunk_size=3)
    lp.sum().backward()
    assert ent is None and called and not [name for name in called if "entropy" in name]
    called.clear()
    lp, ent = compiled(hidden, weight, labels, chunk_size=3)
    ent.sum().backward()
    assert "_forward_stats_entropy" in called and "_grad_logits_entropy" in called


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no toolchain for this device")


def test_backend_that_may_fail_falls_back_to_eager_with_one_logged_line(caplog):
    kernels = flc.CompiledChunkKernels(fallback_to_eager=True, backend=_failing_backend)
    y, labels = torch.randn(6, 9), torch.randint(0, 9, (6,))
    with caplog.at_level(logging.WARNING, logger=flc.__name__):
        first = kernels.forward_stats(y, labels, True)
        second = kernels.forward_stats(y, labels, True)
    assert len([r for r in caplog.records if "torch.compile failed" in r.getMessage()]) == 1
    expected = flc._forward_stats_entropy(y, labels)
    for got in (first, second):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
    strict = flc.CompiledChunkKernels(fallback_to_eager=False, backend=_failing_backend)
    with pytest.raises(Exception, match="no toolchain"):
        strict.forward_stats(y, labels, True)


class _Standin:
    def __init__(self, reason, may_fail=False, by_default=True):
        self.reason, self.compile_may_fail, self.compile_by_default = reason, may_fail, by_default

    def compile_unsupported(self):
        return self.reason

    def compile_backend(self):
        return "inductor"


def test_fused_kernel_impl_resolution_follows_the_backend(monkeypatch):
    assert flc.resolve_fused_kernel_impl("auto", _Standin(None)) == ("compiled", False)
    assert flc.resolve_fused_kernel_impl("auto", _Standin("no compiler")) == ("eager", False)
    assert flc.resolve_fused_kernel_impl("auto", _Standin(None, by_default=False)) == ("eager", False)
    assert flc.resolve_fused_kernel_impl("compiled", _Standin(None, by_default=False)) == ("compiled", False)
    assert flc.resolve_fused_kernel_impl("eager", _Standin(None)) == ("eager", False)
    assert flc.resolve_fused_kernel_impl("compiled", _Standin(None, may_fail=True)) == ("compiled", True)
    with pytest.raises(ConfigFieldError, match=r"^EngineConfig.fused_kernel_impl: 'compiled' is not available: "
                                               r"no compiler$"):
        flc.resolve_fused_kernel_impl("compiled", _Standin("no compiler"))
    with pytest.raises(ConfigFieldError, match=r"^EngineConfig.fused_kernel_impl: got 'fast'; allowed values"):
        EngineConfig(fused_kernel_impl="fast")
    assert CPUBackend().compile_unsupported() is None  # g++ is on this machine's PATH
    monkeypatch.setenv("CXX", "no-such-compiler++")
    assert "'no-such-compiler++' is not on PATH" in CPUBackend().compile_unsupported()


def test_unknown_impl_is_refused():
    hidden, weight, labels = make(3, 4, 5)
    with pytest.raises(ValueError, match=r"impl must be one of 'eager', 'compiled'; got 'triton'"):
        fused_logprob_entropy(hidden, weight, labels, impl="triton")


def test_backends_declare_compile_support():
    import importlib.util

    from polyfsdp.backends.cuda import CUDABackend
    from polyfsdp.backends.npu import NPUBackend

    npu = NPUBackend()
    # The NPU's compiler is torchair's, which needs torch_npu (tests/cpu/backends/test_npu_compile.py).
    assert "needs torch_npu" in npu.compile_unsupported() and npu.compile_may_fail is True
    assert CPUBackend().compile_may_fail is False and CUDABackend().compile_may_fail is False
    # auto: compiled on accelerators, eager on the CPU (compile time outweighs the head there).
    assert npu.compile_by_default and CUDABackend().compile_by_default and not CPUBackend().compile_by_default
    cuda_reason = CUDABackend().compile_unsupported()
    assert (cuda_reason is None) == (importlib.util.find_spec("triton") is not None)


@pytest.mark.parametrize("impl", ["eager", "compiled"])
def test_engine_fused_head_with_each_impl_matches_per_sequence_reference(impl):
    from tests.helpers.engine_reference import full_state_dict, no_padding_batch, reference_logprobs, reference_model, sequences

    from polyfsdp.engines.engine import FSDPEngine
    from polyfsdp.engines.config import ModelConfig

    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=3),
                        EngineConfig(use_fused_kernels=True, fused_kernel_impl=impl)).initialize()
    assert engine.head.fused_impl == (impl, False)
    seqs = sequences([6, 1, 12, 3], seed=11)
    temps = torch.tensor([1.0, 0.7, 1.3, 0.5])
    out = engine.infer_batch(no_padding_batch(seqs), temperature=temps)
    with torch.no_grad():
        exp_lp, exp_ent = reference_logprobs(reference_model("qwen2-tiny", full_state_dict(engine.module)), seqs,
                                             temps.tolist())
    assert (out["log_probs"].values().double() - torch.cat(exp_lp)).abs().max() <= 1e-5
    assert (out["entropy"].values().double() - torch.cat(exp_ent)).abs().max() <= 1e-5
