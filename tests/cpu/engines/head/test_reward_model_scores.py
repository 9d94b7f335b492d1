"""A reward model (ModelConfig(score_head=True)) against Hugging Face's own forward of the same
checkpoint: ``infer_scores`` in all 8 mode combinations (and under a micro-batch budget) equals
``*ForSequenceClassification(...).logits`` of each sequence alone, fp32, 1e-5; a checkpoint
without a trained score layer, one with num_labels=2 and the wrong inference call are refused."""
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.helpers.engine_reference import left_right_batch, no_padding_batch, sequences
from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.presets import preset_config

TOL = 1e-5
LENGTHS = [6, 2, 12, 7, 3]
MODES = [(rm, fu, pm) for rm in (True, False) for fu in (True, False) for pm in ("no_padding", "left_right")]
IDS = [f"rmpad{int(a)}-fused{int(b)}-{c}" for a, b, c in MODES]


def write_reward_model(directory, preset: str, seed: int = 3, num_labels: int = 1) -> str:
    """A tiny random ``*ForSequenceClassification`` checkpoint of ``preset`` (the score layer
    drawn large enough that a wrong token or layer shows)."""
    config = preset_config(preset, num_labels=num_labels, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=["qwen2-tiny", "llama-tiny"])
def reward_model(request, tmp_path_factory):
    path = write_reward_model(tmp_path_factory.mktemp(request.param), request.param)
    engine = FSDPEngine(ModelConfig(path=path, score_head=True), EngineConfig()).initialize()
    reference = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    seqs = sequences(LENGTHS, seed=21)
    with torch.no_grad():
        expected = torch.stack([reference(input_ids=s[None], use_cache=False).logits[0, 0] for s in seqs])
    return engine, seqs, expected


@pytest.mark.parametrize("rmpad,fused,pad_mode", MODES, ids=IDS)
def test_scores_equal_hf_sequence_classification(reward_model, rmpad, fused, pad_mode):
    engine, seqs, expected = reward_model
    engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                   pad_mode=pad_mode)
    batch = (no_padding_batch if pad_mode == "no_padding" else left_right_batch)(seqs)
    scores = engine.infer_scores(batch)
    assert scores.shape == (len(seqs),) and scores.dtype == torch.float32
    assert (scores - expected).abs().max().item() <= TOL
    # The sequences' scores differ by far more than the tolerance: a mix-up would show.
    assert (expected[:, None] - expected[None, :]).abs().add(torch.eye(len(seqs))).min().item() > 100 * TOL


def test_scores_under_a_micro_batch_budget(reward_model):
    engine, seqs, expected = reward_model
    engine.engine_config = replace(EngineConfig(), max_tokens_per_micro_batch=8)
    assert (engine.infer_scores(no_padding_batch(seqs)) - expected).abs().max().item() <= TOL


def test_refusals(tmp_path):
    two = write_reward_model(tmp_path / "two", "qwen2-tiny", num_labels=2)
    with pytest.raises(ValueError, match=r"num_labels=2\); a reward model needs num_labels=1"):
        FSDPEngine(ModelConfig(path=two, score_head=True), EngineConfig()).initialize()
    lm = tmp_path / "lm"
    AutoModelForCausalLM.from_config(preset_config("qwen2-tiny")).save_pretrained(lm)
    with pytest.raises(ValueError, match="holds no trained score layer"):
        FSDPEngine(ModelConfig(path=str(lm), score_head=True), EngineConfig()).initialize()
    policy = FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig()).initialize()
    with pytest.raises(ValueError, match="no score head"):
        policy.infer_scores(no_padding_batch(sequences([3])))
