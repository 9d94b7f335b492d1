"""A one-rank engine runs the plain model (no FSDP2) unless told to shard or a mixed-precision
cast needs FSDP2 (EngineConfig.shard_single_rank, engines/parallel/fsdp.py). Both kinds train
to the plain-torch reference step, and their checkpoints load into each other."""
import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.helpers.engine_cases import LENGTHS, LR, PRESET, engine_config, masks_for, optim_config, reference_sft_step
from tests.helpers.engine_reference import (assert_params_close_after_adam_step, full_state_dict, left_right_batch,
                              no_padding_batch, sequences)
from polyfsdp.engines.config import ConfigFieldError, EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import SFTLoss

GRAD_TOL = 1e-7  # as test_engine_train.py


def _engine(sharded, **overrides):
    return FSDPEngine(ModelConfig(preset=PRESET, seed=5), engine_config(shard_single_rank=sharded, **overrides),
                      optim_config()).initialize()


def _is_sharded(engine):
    return isinstance(engine.module, FSDPModule) and all(isinstance(p, DTensor) for p in engine.module.parameters())


def test_one_rank_is_plain_by_default_and_sharded_when_asked_or_casting():
    assert not _is_sharded(_engine(False))
    assert not any(isinstance(p, DTensor) for p in _engine(False).module.parameters())
    assert _is_sharded(_engine(True))
    # fp32 weights computed in bf16: FSDP2's mixed precision does the casts, so it shards.
    assert _is_sharded(_engine(False, param_dtype="bfloat16"))
    with pytest.raises(ConfigFieldError, match="shard_single_rank"):
        EngineConfig(shard_single_rank="yes")


@pytest.fixture(scope="module")
def data():
    seqs = sequences(LENGTHS, seed=21)
    return seqs, masks_for(seqs)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("rmpad,fused,pad_mode", [(True, True, "no_padding"), (False, False, "left_right")])
def test_plain_and_sharded_one_rank_engines_train_to_the_reference(data, sharded, rmpad, fused, pad_mode):
    seqs, masks = data
    engine = _engine(sharded, use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode)
    initial = full_state_dict(engine.module)
    expected, grads, ref_loss, ref_norm = reference_sft_step(initial, seqs, masks)
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    metrics = engine.train_batch(build(seqs, per_token={"response_mask": masks}), SFTLoss())
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert_params_close_after_adam_step(full_state_dict(engine.module), expected, grads, LR, GRAD_TOL)


def _optim_state(engine):
    out = {}
    for pid, state in engine.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[(pid, key)] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


@pytest.mark.parametrize("saved_sharded", [True, False])
def test_checkpoints_load_across_plain_and_sharded_one_rank_engines(data, tmp_path, saved_sharded):
    seqs, masks = data
    batch = no_padding_batch(seqs, per_token={"response_mask": masks})
    source = _engine(saved_sharded)
    source.train_batch(batch, SFTLoss())
    source.save_checkpoint(tmp_path)
    target = FSDPEngine(ModelConfig(preset=PRESET, seed=9), engine_config(shard_single_rank=not saved_sharded),
                        optim_config()).initialize()
    assert _is_sharded(target) != saved_sharded
    assert target.load_checkpoint(tmp_path)[0] == 1
    for name, value in full_state_dict(source.module).items():
        torch.testing.assert_close(full_state_dict(target.module)[name], value, atol=0, rtol=0, msg=name)
    source_state, target_state = _optim_state(source), _optim_state(target)
    assert source_state.keys() == target_state.keys()
    for key, value in source_state.items():
        torch.testing.assert_close(target_state[key], value, atol=0, rtol=0, msg=str(key))
    # Continuing from the loaded state takes the same step as continuing the saved engine.
    source.train_batch(batch, SFTLoss())
    target.train_batch(batch, SFTLoss())
    for name, value in full_state_dict(source.module).items():
        torch.testing.assert_close(full_state_dict(target.module)[name], value, atol=1e-7, rtol=0, msg=name)
