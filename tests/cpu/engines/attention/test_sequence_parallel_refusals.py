"""Sequence-parallel set-up refuses what it cannot run, in one line naming the cause (the
numbers themselves: tests/distributed/test_sequence_parallel.py)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from polyfsdp.engines.attention import register_attention
from polyfsdp.engines.config import ConfigFieldError, EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.presets import preset_config
from polyfsdp.engines.attention.ulysses import PREFIX, install_ulysses


def _model(attn="polyfsdp_varlen_sdpa", **overrides):
    register_attention()
    return AutoModelForCausalLM.from_config(preset_config("qwen2-tiny", **overrides), attn_implementation=attn)


@pytest.mark.parametrize("value", [0, -2, True, 1.5])
def test_bad_sp_size_names_the_field(value):
    with pytest.raises(ConfigFieldError, match="EngineConfig.ulysses_sp_size"):
        EngineConfig(ulysses_sp_size=value)


def test_sp_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="ulysses_sp_size=2 must divide the world size 1"):
        FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig(ulysses_sp_size=2)).initialize()


def test_heads_not_divisible_by_sp_are_refused_naming_the_counts():
    with pytest.raises(ValueError, match=r"num_attention_heads=4, num_key_value_heads=2"):
        install_ulysses(_model(), 3)


def test_attention_without_sequence_boundaries_is_refused():
    with pytest.raises(ValueError, match="this model uses 'eager'"):
        install_ulysses(_model("eager"), 2)


def test_install_wraps_the_models_attention_and_keeps_it_for_plain_forwards():
    model = _model()
    install_ulysses(model, 2)
    assert model.config._attn_implementation == PREFIX + "polyfsdp_varlen_sdpa"
    # Without a sequence-parallel context (e.g. generation) the inner attention runs as before.
    reference = _model()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    want = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, want)
