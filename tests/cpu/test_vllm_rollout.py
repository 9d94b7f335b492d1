"""vLLM as the rollout engine (trainer/rollout/vllm.py) against independent references: its
greedy completions equal our decoding loop's token for token (qwen2, qwen3, llama, fp32);
after every GRPO step its log-probs of the tokens it sampled equal the policy's recomputed
ones (a missed or partial weight sync fails that); a request's own seed (its row's, 63 bits)
draws its completion whatever else the batch holds; a parameter left out of the sync makes
``rollout.check_sync`` stop the run. One vLLM engine per model family for the whole module
(starting one takes seconds)."""
import random

import pytest
import torch

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.trainer.config.job import ConfigError, RolloutSection, load_config
from polyfsdp.trainer.algos.rl_step import rl_step
from polyfsdp.trainer.rollout.engines import PolicyDecoding, build_rollout_engine
from polyfsdp.trainer.rollout.row_seeds import RowSeeds
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.task import ReverseTask
from vllm_cases import require_vllm, write_checkpoint

TOK = CharTokenizer()
PROMPTS = [[TOK.bos_token_id] + TOK.encode(s) for s in ("abc=", "ba=", "hgfe=", "a=", "dcba+ab=")]
FAMILIES = ("qwen2-tiny", "qwen3-tiny", "llama-tiny")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``(preset, seed, rollout settings) -> (policy, vLLM rollout engine)``, built on first use
    and closed at the module's end: vLLM's process-wide state goes with the first engine shut
    down, so none is closed while others are still used."""
    require_vllm()
    built = {}

    def get(preset, seed=3, model=(), lora=(), **rollout):
        key = (preset, seed, model, lora, tuple(sorted(rollout.items())))
        if key not in built:
            path = write_checkpoint(tmp_path_factory.mktemp(preset), preset, TOK, seed=seed, **dict(model))
            policy = FSDPEngine(ModelConfig(path=path, lora=dict(lora) or None), EngineConfig(),
                                OptimConfig(lr=1e-2)).initialize()
            settings = RolloutSection(engine="vllm", **{"check_sync_tol": 1e-5, **rollout})
            built[key] = policy, build_rollout_engine(settings, get_backend())
        return built[key]

    yield get
    for _, sampler in built.values():
        sampler.close()


def _mid_sequence_token(rows):
    """A token some greedy rows emit and others never: as EOS it ends rows at different steps."""
    counts = {}
    for row in rows:
        for tok in set(row[1:-1]):
            counts[tok] = counts.get(tok, 0) + 1
    partial = sorted(t for t, c in counts.items() if 0 < c < len(rows))
    assert partial, rows
    return partial[0]


@pytest.mark.parametrize("preset", FAMILIES)
def test_greedy_completions_equal_the_builtin_loop(engines, preset):
    policy, sampler = engines(preset)
    builtin = PolicyDecoding("builtin")
    free = builtin.generate(policy, TOK, PROMPTS, 12, do_sample=False)
    tok = CharTokenizer()
    tok.eos_token_id = _mid_sequence_token(free)
    ours, our_lp = builtin.generate(policy, tok, PROMPTS, 12, do_sample=False, return_log_probs=True)
    theirs, their_lp = sampler.generate(policy, tok, PROMPTS, 12, do_sample=False, return_log_probs=True)
    assert theirs == ours
    ended = [row for row in ours if row[-1] == tok.eos_token_id]
    assert ended and len(ended) < len(ours)  # EOS ended some rows (kept in the completion), others ran on
    assert max(abs(a - b) for x, y in zip(our_lp, their_lp) for a, b in zip(x, y)) < 1e-5
    assert sampler.last_sync_error < 1e-5  # the start's probe check ran


def _grpo(lr=1e-2):
    cfg = load_config(["algo.rollout_correction.report_mismatch=true", "algo.actor.group_size=4",
                       "trainer.prompts_per_step=4", "algo.actor.kl_coef=0", "algo.actor.temperature=0.8",
                       f"algo.actor.optim.lr={lr}"])
    task = ReverseTask()
    examples = [[task.sample(random.Random(100 * step + i)) for i in range(4)] for step in range(3)]
    return cfg.algo, cfg.algo.actor_loss(4), examples


def test_sampled_log_probs_match_the_policy_after_every_rl_step(engines):
    algo, loss, examples = _grpo()
    # Small buckets (every decoder layer in a load of its own); tied embeddings, which vLLM's
    # copy holds untied (its reload would leave a tied LM head stale).
    policy, sampler = engines("qwen2-tiny", seed=5, model=(("tie_word_embeddings", True),), sync_bucket_mb=0.01)
    assert policy.module.config.tie_word_embeddings
    before = [p.detach().clone() for p in policy.module.parameters()]
    for step, batch in enumerate(examples):
        metrics = rl_step(policy, None, TOK, batch, algo, loss, sample_seed=step, sampler=sampler)
        # The loss compares vLLM's log-probs with the policy's own, before this step's update.
        assert metrics["rollout_mismatch_abs_max"] < 1e-5, (step, metrics["rollout_mismatch_abs_max"])
        assert sampler.weight_version == step + 1 and policy.weights_version == step + 1
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(policy.module.parameters(), before))
    assert moved > 1e-3  # the weights vLLM had to follow did change


def test_lora_policy_is_served_merged_after_every_step(engines):
    pytest.importorskip("peft")
    algo, loss, examples = _grpo()
    policy, sampler = engines("qwen2-tiny", seed=7, lora=(("rank", 4), ("alpha", 8)))
    adapters = [p for n, p in policy.module.named_parameters() if "lora_B" in n]
    for step, batch in enumerate(examples[:2]):
        metrics = rl_step(policy, None, TOK, batch, algo, loss, sample_seed=step, sampler=sampler)
        assert metrics["rollout_mismatch_abs_max"] < 1e-5, (step, metrics["rollout_mismatch_abs_max"])
    assert max(p.abs().max().item() for p in adapters) > 1e-3  # B left zero: merged == base, nothing tested
    sampler.generate(policy, TOK, PROMPTS, 2, do_sample=False)  # syncs the last step's adapters, checks them


def test_a_row_seed_draws_the_same_completion_in_any_batch(engines):
    policy, sampler = engines("qwen2-tiny")
    prompts = PROMPTS * 3
    seeds = RowSeeds(4, 1).rows(0, len(prompts), 1)
    assert max(seeds) >= 2**40  # 63-bit seeds, as trainer/rollout/row_seeds.py derives them
    rows = sampler.generate(policy, TOK, prompts, 6, True, row_seeds=seeds)
    assert len(set(map(tuple, rows))) > len(PROMPTS)  # sampled: a prompt's rows differ
    half = len(prompts) // 2
    first = sampler.generate(policy, TOK, prompts[:half], 6, True, row_seeds=seeds[:half])
    second = sampler.generate(policy, TOK, prompts[half:][::-1], 6, True, row_seeds=seeds[half:][::-1])
    assert first + second[::-1] == rows


def test_a_parameter_left_out_of_the_sync_stops_the_run(engines, monkeypatch):
    algo, loss, examples = _grpo()
    policy, sampler = engines("qwen2-tiny")
    stream = sampler.buckets
    left_out = "model.layers.1.mlp.down_proj.weight"

    def without_one(module, bucket_bytes, untie):
        for bucket in stream(module, bucket_bytes, untie):
            yield [(name, tensor) for name, tensor in bucket if name != left_out]

    monkeypatch.setattr(sampler, "buckets", without_one)
    rl_step(policy, None, TOK, examples[0], algo, loss, sample_seed=0, sampler=sampler)  # syncs, then trains
    with pytest.raises(ConfigError, match=r"rollout.check_sync: after weight sync \d+, vLLM's log-probs"):
        sampler.generate(policy, TOK, PROMPTS, 4, do_sample=False)


def test_a_model_vllm_cannot_serve_is_one_line_naming_the_fix(engines):
    # Head size 16: vLLM's CPU attention has no kernel for it.
    policy, sampler = engines("llama-tiny", model=(("hidden_size", 32), ("head_dim", 16)), check_sync=False)
    with pytest.raises(ConfigError, match="vLLM cannot serve this model .*use rollout.engine=auto") as err:
        sampler.generate(policy, TOK, PROMPTS, 4, do_sample=False)
    assert "\n" not in str(err.value)


def test_a_model_of_32_positions_starts_and_checks_its_sync(engines):
    # The sync probe was 32 tokens: vLLM refused it on such a model (prompt + 1 > 32) at start.
    policy, sampler = engines("llama-tiny", model=(("max_position_embeddings", 32),))
    completions = sampler.generate(policy, TOK, PROMPTS, 4, do_sample=False)
    assert len(completions) == len(PROMPTS) and len(sampler.probe) == 31
    assert sampler.last_sync_error is not None and sampler.last_sync_error <= 1e-5
