"""Bad batches and arguments get errors that say what was expected and what was given."""
import pytest
import torch
from tensordict import TensorDict

from tests.helpers.engine_reference import jagged_of, left_right_batch, no_padding_batch, sequences
from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import SFTLoss


@pytest.fixture(scope="module")
def engine():
    return FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig()).initialize()


def test_no_padding_mode_rejects_dense_input_ids(engine):
    batch = TensorDict({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, batch_size=[2])
    with pytest.raises(TypeError, match=r"batch\['input_ids'\] must be a jagged nested tensor"):
        engine.infer_batch(batch)


def test_left_right_mode_needs_attention_mask(engine):
    from dataclasses import replace

    batch = left_right_batch(sequences([3, 2]))
    del batch["attention_mask"]
    previous = engine.engine_config
    engine.engine_config = replace(previous, pad_mode="left_right")
    try:
        with pytest.raises(ValueError, match=r"needs batch\['attention_mask'\]"):
            engine.infer_batch(batch)
    finally:
        engine.engine_config = previous


def test_per_token_field_with_other_offsets_is_rejected(engine):
    seqs = sequences([3, 2])
    batch = no_padding_batch(seqs)
    batch["response_mask"] = jagged_of([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match=r"batch\['response_mask'\]: its offsets \[0, 2, 5\] differ from "
                                         r"input_ids' \[0, 3, 5\]"):
        engine.train_batch(batch, SFTLoss())


def test_temperature_of_wrong_shape_or_sign_is_rejected(engine):
    batch = no_padding_batch(sequences([3, 2]))
    with pytest.raises(ValueError, match=r"expected a float or a \(2,\) tensor, got shape \(3,\)"):
        engine.infer_batch(batch, temperature=torch.ones(3))
    with pytest.raises(ValueError, match="every value must be > 0"):
        engine.infer_batch(batch, temperature=torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="expected a float > 0"):
        engine.infer_batch(batch, temperature=-1.0)


def test_engine_needs_initialize_and_typed_configs():
    with pytest.raises(RuntimeError, match="call initialize"):
        FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig()).module
    with pytest.raises(TypeError, match="engine_config: expected EngineConfig, got dict"):
        FSDPEngine(ModelConfig(preset="qwen2-tiny"), {"pad_mode": "no_padding"})


def test_infinite_temperature_is_rejected_in_every_mode(engine):
    # The fused path refused it while the unfused one returned uniform log-probs: one rule for both.
    from dataclasses import replace

    batch = no_padding_batch(sequences([3, 2]))
    previous = engine.engine_config
    try:
        for fused in (False, True):
            engine.engine_config = replace(previous, use_fused_kernels=fused)
            with pytest.raises(ValueError, match="finite"):
                engine.infer_batch(batch, temperature=float("inf"))
            with pytest.raises(ValueError, match="finite"):
                engine.infer_batch(batch, temperature=torch.tensor([1.0, float("inf")]))
    finally:
        engine.engine_config = previous


def test_token_ids_outside_the_vocabulary_or_not_integer_are_rejected(engine):
    vocab = engine.module.config.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {vocab}\); got values in \[1, {vocab}\]"):
        engine.infer_batch(no_padding_batch([torch.tensor([1, vocab, 3])]))
    with pytest.raises(ValueError, match=r"got values in \[-1, 3\]"):
        engine.infer_batch(no_padding_batch([torch.tensor([1, -1, 3])]))
    with pytest.raises(TypeError, match="input_ids must be an integer tensor; got torch.float32"):
        engine.infer_batch(no_padding_batch([torch.tensor([1.0, 2.0])]))


def test_per_sequence_value_for_a_per_token_loss_field_is_a_clear_error(engine):
    from polyfsdp.engines.losses import PPOLoss

    seqs = sequences([3, 2])
    batch = no_padding_batch(seqs, per_token={"response_mask": [torch.ones(3), torch.ones(2)],
                                              "old_log_probs": [torch.zeros(3), torch.zeros(2)]},
                             per_seq={"advantages": torch.ones(2)})
    with pytest.raises(ValueError, match=r"batch\['advantages'\] has one value per sequence \(shape \(2,\)\); "
                                         r"PPOLoss needs it per token"):
        engine.train_batch(batch, PPOLoss())


@pytest.mark.parametrize("loss_fn", [None, "sft", 3], ids=["none", "string", "int"])
def test_a_loss_that_is_not_callable_is_a_clear_type_error_before_anything_runs(engine, loss_fn):
    seqs = sequences([3, 2])
    batch = no_padding_batch(seqs, per_token={"response_mask": [torch.ones(3), torch.ones(2)]})
    step = engine.global_step
    with pytest.raises(TypeError, match=r"loss_fn must be a callable taking LossInputs .* such as SFTLoss\(\)"):
        engine.train_batch(batch, loss_fn)
    assert engine.global_step == step
    assert all(p.grad is None for p in engine.module.parameters())
