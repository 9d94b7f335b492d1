"""engine.offload on the CPU backend: a documented no-op with a one-line notice, and the
host gradient-norm helper of the offload path (engines/parallel/offload.py) against torch's norm."""
import logging

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.engine_reference import no_padding_batch, sequences
from tests.helpers.engine_cases import masks_for
from polyfsdp.engines.config import ConfigFieldError, EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import SFTLoss
from polyfsdp.engines.parallel.offload import host_grad_norm

LENGTHS = [6, 1, 9, 4]


def test_bad_offload_value_names_the_key():
    with pytest.raises(ConfigFieldError, match=r"^engine\.offload: got 'gpu'.*'optimizer'"):
        EngineConfig.from_dict({"offload": "gpu"}, where="engine")


def test_offload_on_cpu_is_a_noop_with_one_notice(caplog):
    seqs = sequences(LENGTHS, seed=1)
    batch = no_padding_batch(seqs, per_token={"response_mask": masks_for(seqs)})
    results = {}
    for mode in ("none", "optimizer", "params"):
        with caplog.at_level(logging.WARNING, logger="polyfsdp.engines.parallel.offload"):
            caplog.clear()
            engine = FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig(offload=mode),
                                OptimConfig(lr=1e-2)).initialize()
        notices = [r.getMessage() for r in caplog.records if r.name == "polyfsdp.engines.parallel.offload"]
        assert len(notices) == (mode != "none"), notices
        if notices:
            assert "does nothing on the cpu backend" in notices[0] and "\n" not in notices[0]
        results[mode] = [engine.train_batch(batch, SFTLoss())["loss"] for _ in range(2)]
        assert type(engine.optimizer) is torch.optim.AdamW  # no host step where the host is the device
    assert results["params"] == results["none"] == results["optimizer"]


def test_host_grad_norm_equals_torch_total_norm():
    # Sharded on one rank (a one-rank world runs the plain model otherwise): DTensor gradients.
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig(shard_single_rank=True)).initialize()
    seqs = sequences(LENGTHS, seed=2)
    engine.forward_backward(no_padding_batch(seqs, per_token={"response_mask": masks_for(seqs)}), SFTLoss())
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    assert grads and all(isinstance(g, DTensor) for g in grads)
    plain = [g.full_tensor() for g in grads]
    want = torch.linalg.vector_norm(torch.cat([g.flatten().double() for g in plain]))
    got = host_grad_norm(grads, torch.device("cpu"))
    assert abs(float(got) - float(want)) <= 1e-6 * float(want)
    engine.optimizer.zero_grad()
