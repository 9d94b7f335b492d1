"""engine.offload=params and =optimizer on a GPU: bf16 compute, lower peak device memory than
without offload, the same losses within bf16 tolerance (also run by scripts/validate_accelerator.sh)."""
from __future__ import annotations


import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.engine_cases import masks_for  # noqa: E402
from tests.helpers.engine_reference import no_padding_batch  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.engines.losses import SFTLoss  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A large vocabulary makes parameters, gradients and AdamW state dominate a short batch.
VOCAB = 32000


def _run(offload: str):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", vocab_size=VOCAB),
                        EngineConfig(param_dtype="bfloat16", offload=offload), OptimConfig(lr=1e-3)).initialize()
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(3):
        seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (8, 5, 12, 7)]
        losses.append(engine.train_batch(no_padding_batch(seqs, per_token={"response_mask": masks_for(seqs)}),
                                         SFTLoss())["loss"])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    on_host = all(_local(p).device.type == "cpu" for p in engine.module.parameters())
    # AdamW's moments ("step" is a host scalar in torch's AdamW either way).
    state_on_host = all(_local(v).device.type == "cpu" for s in engine.optimizer.state.values()
                        for k, v in s.items() if k != "step")
    del engine
    return losses, peak, on_host, state_on_host


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def test_params_offload_lowers_peak_memory_and_keeps_the_losses():
    base_losses, base_peak, base_on_host, _ = _run("none")
    off_losses, off_peak, off_on_host, _ = _run("params")
    assert not base_on_host and off_on_host
    assert off_peak < base_peak, (off_peak, base_peak)
    # bf16 compute: both runs round the same way up to reduction order.
    torch.testing.assert_close(torch.tensor(off_losses), torch.tensor(base_losses), rtol=2e-2, atol=2e-2)
    print(f"peak device memory: offload=params {off_peak / 2**20:.1f} MiB vs none {base_peak / 2**20:.1f} MiB")


def test_optimizer_offload_keeps_adamw_state_on_the_host_and_lowers_peak_memory():
    base_losses, base_peak, _, base_state_on_host = _run("none")
    off_losses, off_peak, params_on_host, state_on_host = _run("optimizer")
    assert not base_state_on_host and state_on_host and not params_on_host
    assert off_peak < base_peak, (off_peak, base_peak)
    # The host step is torch's own AdamW math on the same fp32 shards: bf16 compute tolerance.
    torch.testing.assert_close(torch.tensor(off_losses), torch.tensor(base_losses), rtol=2e-2, atol=2e-2)
    print(f"peak device memory: offload=optimizer {off_peak / 2**20:.1f} MiB vs none {base_peak / 2**20:.1f} MiB")


@pytest.mark.parametrize("shard", [False, True])
def test_optimizer_offload_checkpoint_resumes_exactly_on_the_gpu(tmp_path, shard):
    """fp32, deterministic kernels (tests/cuda/conftest.py): the host AdamW state goes through
    DCP (host-backed DTensors on a GPU mesh when sharded) and comes back on the host."""
    def engine(seed):
        return FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=seed), EngineConfig(offload="optimizer",
                                                                                     shard_single_rank=shard),
                          OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)).initialize()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        seqs = [torch.randint(0, 128, (n,), generator=g) for n in (8, 5, 12, 7)]
        batches.append(no_padding_batch(seqs, per_token={"response_mask": masks_for(seqs)}))
    source = engine(5)
    for batch in batches[:2]:
        source.train_batch(batch, SFTLoss())
    source.save_checkpoint(tmp_path)
    source.train_batch(batches[2], SFTLoss())
    target = engine(9)
    assert target.load_checkpoint(tmp_path)[0] == 2
    assert all(_local(v).device.type == "cpu" for s in target.optimizer.state.values() for v in s.values())
    target.train_batch(batches[2], SFTLoss())
    want = dict(source.module.named_parameters())
    for name, param in target.module.named_parameters():
        assert torch.equal(_full(param), _full(want[name])), name


def _full(tensor):
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
