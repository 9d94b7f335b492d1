"""A checkpoint whose weights are not the model its config.json describes (another hidden size or
vocabulary, layers missing or extra) is named tensor by tensor, before any weights load
(engines/model/weights_fit.py), and the engine's load refuses a shape mismatch in one line
instead of transformers' multi-line report and RuntimeError (engines/model/builder.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from polyfsdp.engines.config import ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.model.builder import read_hf_config
from polyfsdp.engines.model.weights_fit import weights_mismatch
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from tests.helpers.engine_cases import engine_config
from tests.helpers.vllm_cases import write_checkpoint


def _checkpoint(path: Path, **config_edits) -> str:
    """A tiny checkpoint (hidden 64, 2 layers) whose config.json is then edited."""
    write_checkpoint(path, "qwen2-tiny", CharTokenizer(), seed=5, tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **config_edits}))
    return str(path)


def _mismatch(directory: str) -> str | None:
    return weights_mismatch(directory, read_hf_config(directory), AutoModelForCausalLM)


def test_the_weights_of_their_own_config_match(tmp_path):
    assert _mismatch(_checkpoint(tmp_path / "same")) is None
    tied = tmp_path / "tied"  # lm_head is stored once, as the embedding
    write_checkpoint(tied, "qwen2-tiny", CharTokenizer(), seed=5, tie_word_embeddings=True)
    assert _mismatch(str(tied)) is None


def test_the_first_mismatching_tensor_is_named_with_both_shapes(tmp_path):
    vocab = len(CharTokenizer().vocab)
    text = _mismatch(_checkpoint(tmp_path / "vocab", vocab_size=200))
    assert text == f"lm_head.weight is [{vocab}, 64] in the weights, but its config.json builds it as [200, 64]"
    text = _mismatch(_checkpoint(tmp_path / "mlp", intermediate_size=100))
    assert text == "model.layers.0.mlp.down_proj.weight is [64, 128] in the weights, but its config.json builds it " \
        "as [64, 100]", text


def test_layers_missing_or_extra_are_named(tmp_path):
    more = _mismatch(_checkpoint(tmp_path / "more", num_hidden_layers=3, layer_types=["full_attention"] * 3))
    assert more.startswith("its config.json builds 12 tensor(s) the weights lack: model.layers.2."), more
    fewer = _mismatch(_checkpoint(tmp_path / "fewer", num_hidden_layers=1, layer_types=["full_attention"]))
    assert fewer.startswith("the weights hold 12 tensor(s) its config.json does not build: model.layers.1."), fewer
    assert fewer.endswith("and 9 more"), fewer


def test_the_engine_refuses_a_shape_mismatch_in_one_line(tmp_path):
    directory = _checkpoint(tmp_path / "hidden", hidden_size=32)
    with pytest.raises(ValueError) as info:
        FSDPEngine(ModelConfig(path=directory), engine_config()).initialize()
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"ModelConfig.path: {directory!r}: the weights are not the model its "
                                                f"config.json describes: "), text
    assert "is [" in text and "in the weights, but its config.json builds it as [" in text, text
