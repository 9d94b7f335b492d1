"""Bad batches and arguments get errors that say what was expected and what was given."""
import pytest
import torch
from tensordict import TensorDict

from engine_reference import jagged_of, left_right_batch, no_padding_batch, sequences
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
