"""engine.offload=optimizer: AdamW state on the host and the step run there
(engines/parallel/host_optimizer.py). On a CPU-only machine the mechanism runs through a backend
stand-in declared as an accelerator; it must take exactly torch AdamW's steps (plain and
sharded model, weight decay and clipping on) and resume exactly from a checkpoint."""
import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.backend_standins import HostMemoryAccelerator
from tests.helpers.engine_cases import LENGTHS, PRESET, engine_config, masks_for, optim_config
from tests.helpers.engine_reference import full_state_dict, no_padding_batch, sequences
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.config import ModelConfig, OptimConfig
from polyfsdp.engines.parallel.host_optimizer import HostAdamW
from polyfsdp.engines.losses import SFTLoss
from polyfsdp.engines.memory import estimate_memory

STEPS = 3


def _engine(offload, sharded, backend=None):
    return FSDPEngine(ModelConfig(preset=PRESET, seed=5), engine_config(offload=offload, shard_single_rank=sharded),
                      optim_config(), backend=backend or HostMemoryAccelerator()).initialize()


def _batches(count):
    out = []
    for step in range(count):
        seqs = sequences(LENGTHS, seed=40 + step)
        out.append(no_padding_batch(seqs, per_token={"response_mask": masks_for(seqs)}))
    return out


def _assert_same_params(actual, expected):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


@pytest.mark.parametrize("sharded", [False, True])
def test_host_step_equals_torch_adamw_over_several_steps(sharded):
    reference, offloaded = _engine("none", sharded), _engine("optimizer", sharded)
    assert type(reference.optimizer) is torch.optim.AdamW and isinstance(offloaded.optimizer, HostAdamW)
    initial = full_state_dict(reference.module)
    _assert_same_params(full_state_dict(offloaded.module), initial)
    for batch in _batches(STEPS):
        want, got = reference.train_batch(batch, SFTLoss()), offloaded.train_batch(batch, SFTLoss())
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
        assert want["grad_norm"] > optim_config().grad_clip  # clipping is exercised
    after = full_state_dict(reference.module)
    assert any(not torch.equal(after[n], initial[n]) for n in initial)  # the steps moved the weights
    _assert_same_params(full_state_dict(offloaded.module), after)
    reference_params = dict(reference.module.named_parameters())
    for name, param in offloaded.module.named_parameters():
        state, want = offloaded.optimizer.state[param], reference.optimizer.state[reference_params[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor) == isinstance(param, DTensor)
            assert torch.equal(_full(state[key]), _full(want[key])), (name, key)


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@pytest.mark.parametrize("sharded", [False, True])
def test_host_optimizer_checkpoint_resumes_exactly(tmp_path, sharded):
    batches = _batches(STEPS)
    source = _engine("optimizer", sharded)
    for batch in batches[:-1]:
        source.train_batch(batch, SFTLoss())
    source.save_checkpoint(tmp_path)
    source.train_batch(batches[-1], SFTLoss())
    # A different seed: every trained value must come from the checkpoint.
    target = FSDPEngine(ModelConfig(preset=PRESET, seed=9),
                        engine_config(offload="optimizer", shard_single_rank=sharded), optim_config(),
                        backend=HostMemoryAccelerator()).initialize()
    assert target.load_checkpoint(tmp_path)[0] == STEPS - 1
    for state in target.optimizer.state.values():
        assert all(_full(v).device.type == "cpu" for v in state.values())
    target.train_batch(batches[-1], SFTLoss())
    _assert_same_params(full_state_dict(target.module), full_state_dict(source.module))


def test_estimate_moves_exactly_the_host_optimizers_state_to_the_host():
    model_config = ModelConfig(preset=PRESET, seed=5)
    config = engine_config(offload="optimizer", shard_single_rank=True)
    offloaded = estimate_memory(model_config, config, world_size=1, tokens=64)
    kept = estimate_memory(model_config, engine_config(shard_single_rank=True), world_size=1, tokens=64)
    on_cpu = estimate_memory(model_config, config, world_size=1, tokens=64, host_backend=True)
    name, peak = "optimizer state (AdamW, trainable only)", "peak step estimate (as configured)"
    assert offloaded.host == {name} and not kept.host and not on_cpu.host
    assert offloaded.rows[peak] == kept.rows[peak] - kept.rows[name] and on_cpu.rows[peak] == kept.rows[peak]
    engine = _engine("optimizer", sharded=True)
    engine.train_batch(_batches(1)[0], SFTLoss())
    state = [_local(v) for s in engine.optimizer.state.values() for v in s.values()]
    assert all(t.device.type == "cpu" for t in state)
    assert offloaded.rows[name] == sum(t.numel() * t.element_size() for t in state)


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def test_host_step_with_lora_trains_only_the_adapters_like_torch_adamw():
    pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    from tests.helpers.lora_cases import lora_engine, step_batch

    reference, offloaded = lora_engine(), lora_engine(backend=HostMemoryAccelerator(), offload="optimizer")
    assert isinstance(offloaded.optimizer, HostAdamW)
    _assert_same_params(full_state_dict(offloaded.module), full_state_dict(reference.module))
    adapters = {p for n, p in offloaded.module.named_parameters() if ".lora_" in n}
    for step in range(2):
        batch = step_batch(step)
        want, got = reference.train_batch(batch, SFTLoss()), offloaded.train_batch(batch, SFTLoss())
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert set(offloaded.optimizer.state) == adapters
    _assert_same_params(full_state_dict(offloaded.module), full_state_dict(reference.module))


def test_adamw_kernel_choice_that_cannot_apply_on_the_host_is_a_notice(caplog):
    with caplog.at_level("WARNING", logger="polyfsdp.engines.model.optim"):
        engine = FSDPEngine(ModelConfig(preset=PRESET), engine_config(offload="optimizer"),
                            OptimConfig(impl="foreach"), backend=HostMemoryAccelerator()).initialize()
    assert isinstance(engine.optimizer, HostAdamW)
    assert [r.getMessage() for r in caplog.records if "OptimConfig.impl='foreach'" in r.getMessage()]
