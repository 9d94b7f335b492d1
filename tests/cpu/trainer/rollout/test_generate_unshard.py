"""Gather-once generation (rollout.unshard) samples exactly what per-layer gathering does,
and leaves the model sharded with its reshard policy afterwards. The engine is sharded on
one rank (shard_single_rank) so that FSDP2's gathers run at all."""
import pytest
import torch
from torch.distributed.tensor import DTensor

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import generate, use_gather_once
from polyfsdp.trainer.data.tokenizers import CharTokenizer


@pytest.mark.parametrize("policy", ["default", "always", "never"])
def test_gather_once_samples_the_same_completions(policy):
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=3, vocab_size=CharTokenizer().vocab_size),
                        EngineConfig(reshard_policy=policy, shard_single_rank=True)).initialize()
    tok = CharTokenizer()
    prompts = [[tok.bos_token_id] + tok.encode(s) for s in ("abc=", "ba=", "hgfe=")]
    out = {}
    for unshard in (False, True, False):
        torch.manual_seed(7)
        sampled = generate(engine, prompts, SamplingParams.for_tokenizer(tok, 6), unshard=unshard)
        out.setdefault(unshard, []).append(sampled.token_ids)
        if unshard:  # resharded on the way out, whatever the policy keeps after a forward
            assert all(isinstance(p, DTensor) for p in engine.module.parameters())
    assert out[True][0] == out[False][0] == out[False][1]


def test_unshard_setting_is_validated():
    assert load_config([]).rollout.unshard == "auto"
    assert load_config(["rollout.unshard=false"]).rollout.unshard is False
    with pytest.raises(ConfigError, match="rollout.unshard"):
        load_config(["rollout.unshard=sometimes"])
    with pytest.raises(ValueError, match="rollout.unshard"):
        use_gather_once(None, "sometimes")


def test_plain_one_rank_engine_samples_what_the_sharded_one_does():
    """The default one-rank engine (no FSDP2) draws the same completions as a sharded one."""
    tok = CharTokenizer()
    prompts = [[tok.bos_token_id] + tok.encode(s) for s in ("abc=", "ba=", "hgfe=")]
    out = []
    for sharded in (True, False):
        engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=3, vocab_size=tok.vocab_size),
                            EngineConfig(shard_single_rank=sharded)).initialize()
        assert any(isinstance(p, DTensor) for p in engine.module.parameters()) == sharded
        torch.manual_seed(7)
        out.append(generate(engine, prompts, SamplingParams.for_tokenizer(tok, 6), unshard=True).token_ids)
    assert out[0] == out[1]
    assert out[0] != [[] for _ in prompts]
