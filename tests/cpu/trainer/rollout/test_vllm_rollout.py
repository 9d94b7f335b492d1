"""vLLM as the rollout engine (trainer/rollout/vllm.py) against independent references: its
greedy completions equal our decoding loop's token for token (qwen2, qwen3, llama, fp32);
after every GRPO step its log-probs of the tokens it sampled equal the policy's recomputed
ones (a missed or partial weight sync fails that); a request's own seed (its row's, 63 bits)
draws its completion whatever else the batch holds; a sync lands every parameter (fused ones
included) without a warning; a parameter left out of the sync stops the run, naming its layer.
One vLLM engine per model family for the whole module (starting one takes seconds)."""
import random

import pytest
import torch

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.algos.rl_step import RLContext, StepSeeds, rl_step
from polyfsdp.trainer.rollout.build import build_rollout_engine
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver
from polyfsdp.trainer.rollout.engines import PolicyDecoding, SamplingParams
from polyfsdp.trainer.rollout.row_seeds import RowSeeds
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.task import ReverseTask
from tests.helpers.vllm_cases import LOAD_WARNINGS, require_vllm, vllm_differences, vllm_log, write_checkpoint

TOK = CharTokenizer()
PROMPTS = [[TOK.bos_token_id] + TOK.encode(s) for s in ("abc=", "ba=", "hgfe=", "a=", "dcba+ab=")]
FAMILIES = ("qwen2-tiny", "qwen3-tiny", "llama-tiny")


def _greedy(max_new_tokens, tok=TOK, return_log_probs=False):
    return SamplingParams.for_tokenizer(tok, max_new_tokens, greedy=True, return_log_probs=return_log_probs)


def _synced_generate(engine, policy, prompts, params, seeds=None):
    """The weight-sync phase, then sampling (what a rollout does)."""
    engine.update_weights(policy)
    return engine.generate(prompts, params, seeds)


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
    for _, engine in built.values():
        engine.close()


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
    policy, vllm = engines(preset)
    builtin = PolicyDecoding("builtin")
    free = _synced_generate(builtin, policy, PROMPTS, _greedy(12)).token_ids
    tok = CharTokenizer()
    tok.eos_token_id = _mid_sequence_token(free)
    ours = builtin.generate(PROMPTS, _greedy(12, tok, return_log_probs=True))
    theirs = _synced_generate(vllm, policy, PROMPTS, _greedy(12, tok, return_log_probs=True))
    ours, our_lp, theirs, their_lp = ours.token_ids, ours.log_probs, theirs.token_ids, theirs.log_probs
    assert theirs == ours
    ended = [row for row in ours if row[-1] == tok.eos_token_id]
    assert ended and len(ended) < len(ours)  # EOS ended some rows (kept in the completion), others ran on
    assert max(abs(a - b) for x, y in zip(our_lp, their_lp) for a, b in zip(x, y)) < 1e-5
    assert vllm.last_sync_error < 1e-5  # the start's probe check ran


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
    policy, vllm = engines("qwen2-tiny", seed=5, model=(("tie_word_embeddings", True),), sync_bucket_mb=0.01)
    assert policy.module.config.tie_word_embeddings
    before = [p.detach().clone() for p in policy.module.parameters()]
    for step, batch in enumerate(examples):
        metrics = rl_step(RLContext(policy, TOK, algo, loss, driver=SingleTurnDriver(vllm)), batch, StepSeeds(step))
        # The loss compares vLLM's log-probs with the policy's own, before this step's update.
        assert metrics["rollout_mismatch_abs_max"] < 1e-5, (step, metrics["rollout_mismatch_abs_max"])
        assert vllm.weight_version == step + 1 and policy.weights_version == step + 1
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(policy.module.parameters(), before))
    assert moved > 1e-3  # the weights vLLM had to follow did change


def test_lora_policy_is_served_merged_after_every_step(engines):
    pytest.importorskip("peft")
    algo, loss, examples = _grpo()
    policy, vllm = engines("qwen2-tiny", seed=7, lora=(("rank", 4), ("alpha", 8)))
    adapters = [p for n, p in policy.module.named_parameters() if "lora_B" in n]
    for step, batch in enumerate(examples[:2]):
        metrics = rl_step(RLContext(policy, TOK, algo, loss, driver=SingleTurnDriver(vllm)), batch, StepSeeds(step))
        assert metrics["rollout_mismatch_abs_max"] < 1e-5, (step, metrics["rollout_mismatch_abs_max"])
    assert max(p.abs().max().item() for p in adapters) > 1e-3  # B left zero: merged == base, nothing tested
    vllm.update_weights(policy)  # syncs the last step's adapters, checks them


def test_a_row_seed_draws_the_same_completion_in_any_batch(engines):
    policy, vllm = engines("qwen2-tiny")
    prompts = PROMPTS * 3
    seeds = RowSeeds(4, 1).rows(0, len(prompts), 1)
    assert max(seeds) >= 2**40  # 63-bit seeds, as trainer/rollout/row_seeds.py derives them
    sampled = SamplingParams.for_tokenizer(TOK, 6)
    rows = _synced_generate(vllm, policy, prompts, sampled, seeds).token_ids
    assert len(set(map(tuple, rows))) > len(PROMPTS)  # sampled: a prompt's rows differ
    half = len(prompts) // 2
    first = vllm.generate(prompts[:half], sampled, seeds[:half]).token_ids
    second = vllm.generate(prompts[half:][::-1], sampled, seeds[half:][::-1]).token_ids
    assert first + second[::-1] == rows


def test_a_rollout_past_vllms_step_token_budget_samples_each_row_as_alone(engines):
    """More prompt tokens than vLLM prefills in one step (4096), each request with its row seed: on
    CPU a prefill vLLM split over steps stopped the rollout ("CPU Generator does not use offset"),
    so there every prompt is prefilled whole (backends' vllm_chunked_prefill)."""
    policy, vllm = engines("qwen2-tiny")
    prompts = [[TOK.bos_token_id] + TOK.encode(("abcdefgh" * 8)[i % 8:][:60]) for i in range(80)]
    assert sum(map(len, prompts)) > 4096
    seeds = RowSeeds(9, 1).rows(0, len(prompts), 1)
    sampled = SamplingParams.for_tokenizer(TOK, 4)
    rows = _synced_generate(vllm, policy, prompts, sampled, seeds).token_ids
    alone = vllm.generate(prompts[-3:], sampled, seeds[-3:]).token_ids
    assert rows[-3:] == alone


def test_greedy_with_a_repetition_penalty_and_a_stop_string_equals_the_builtin_loop(engines):
    """vLLM's own repetition penalty (defined as ours, trainer/rollout/controls/logits_shaping.py) picks
    the same greedy tokens; a stop string (vLLM runs without a tokenizer) cuts at the same one."""
    policy, vllm = engines("qwen2-tiny")
    builtin = PolicyDecoding("builtin")
    plain = _synced_generate(builtin, policy, PROMPTS, _greedy(12)).token_ids
    penalized = SamplingParams.for_tokenizer(TOK, 12, greedy=True, return_log_probs=True, repetition_penalty=1.8)
    ours = _synced_generate(builtin, policy, PROMPTS, penalized)
    theirs = _synced_generate(vllm, policy, PROMPTS, penalized)
    assert ours.token_ids != plain and theirs.token_ids == ours.token_ids
    assert max(abs(a - b) for x, y in zip(ours.log_probs, theirs.log_probs) for a, b in zip(x, y)) < 1e-5
    stop = TOK.decode(ours.token_ids[0])[3:5]
    stopped = SamplingParams.for_tokenizer(TOK, 12, greedy=True, repetition_penalty=1.8, stop=(stop,))
    ours_cut = builtin.generate(PROMPTS, stopped).token_ids
    assert ours_cut[0] != ours.token_ids[0] and vllm.generate(PROMPTS, stopped).token_ids == ours_cut


def test_agents_sample_through_vllm_what_the_environment_api_and_our_loop_sample(engines):
    pytest.importorskip("openai")
    from tests.cpu.trainer.rollout.test_agent_endpoint import agents_agree_with_the_environment_api_and_the_decoding_loop

    policy, engine = engines("qwen2-tiny")
    builtin = PolicyDecoding("builtin")
    builtin.update_weights(policy)
    engine.update_weights(policy)
    agents_agree_with_the_environment_api_and_the_decoding_loop(engine, builtin, TOK)


def test_sampled_log_probs_are_those_of_the_filtered_distribution_as_in_our_loop(engines):
    """vLLM draws with its own generator (not ours), so the tokens differ from our loop's; what
    must agree is the law: every token vLLM drew has, under top-k, top-p and the penalty as our
    loop applies them to the policy's logits, the log-prob vLLM recorded (finite: inside the filter)."""
    from polyfsdp.trainer.rollout.controls.logits_shaping import shape_logits

    policy, vllm = engines("qwen2-tiny")
    params = SamplingParams.for_tokenizer(TOK, 8, temperature=0.9, return_log_probs=True, top_k=6, top_p=0.8,
                                          repetition_penalty=1.3)
    prompts = PROMPTS * 2
    out = _synced_generate(vllm, policy, prompts, params, RowSeeds(3, 2).rows(0, len(prompts), 1))
    model = policy.module.eval()
    for prompt, row, lp in zip(prompts, out.token_ids, out.log_probs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + row])).logits[0, len(prompt) - 1:-1]
        for t, tok in enumerate(row):
            seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
            seen[0, prompt + row[:t]] = True
            ref = float(torch.log_softmax(shape_logits(logits[t:t + 1], params, seen), -1)[0, tok])
            assert abs(ref - lp[t]) < 1e-4, (prompt, row, t, ref, lp[t])


def test_a_sync_lands_every_parameter_without_a_warning(engines):
    """Llama (q/k/v and gate/up fused in vLLM) in buckets of one decoder layer each: every vLLM
    parameter equals the policy's after a sync, and neither the start nor the sync logs a warning
    about loading (vLLM's reload warned per layer outside each bucket) or a traceback (its
    chat-template warmup without a tokenizer)."""
    policy, vllm = engines("llama-tiny", seed=9, sync_bucket_mb=0.01, check_sync=False)
    with vllm_log() as logged:
        vllm.update_weights(policy)  # the start
        with torch.no_grad():
            for param in policy.module.parameters():
                param.add_(torch.randn_like(param) * 0.1)
        policy.weights_version += 1  # what an optimizer step does
        vllm.update_weights(policy)
    assert vllm.weight_version == 2
    noise = [line for line in logged if any(w in line for w in LOAD_WARNINGS) or "Traceback" in line]
    assert not noise, noise[:3]
    assert not vllm_differences(vllm.llm, policy)


@pytest.mark.parametrize("left_out, layer", [
    ("model.layers.1.mlp.down_proj.weight", r"model.layers.1.mlp.down_proj \(0 of 8192 elements\)"),
    # A third of the fused q/k/v: its layer is loaded in part, not skipped.
    ("model.layers.1.self_attn.k_proj.weight", r"model.layers.1.self_attn.qkv_proj \([1-9]\d* of \d+ elements\)"),
])
def test_a_parameter_left_out_of_the_sync_stops_the_run_naming_its_layer(engines, monkeypatch, left_out, layer):
    algo, loss, examples = _grpo()
    # Without the probe check: the sync itself must find what it did not load.
    policy, vllm = engines("qwen2-tiny", seed=11, check_sync=False, sync_bucket_mb=0.01)
    stream = vllm.buckets

    def without_one(module, bucket_bytes, untie):
        for bucket in stream(module, bucket_bytes, untie):
            yield [(name, tensor) for name, tensor in bucket if name != left_out]

    monkeypatch.setattr(vllm, "buckets", without_one)
    driver = SingleTurnDriver(vllm)
    rl_step(RLContext(policy, TOK, algo, loss, driver=driver), examples[0], StepSeeds(0))  # syncs, then trains
    with pytest.raises(ConfigError, match=rf"rollout.engine=vllm: weight sync \d+: 1 of vLLM's layers got none or "
                                          rf"only part of their weights: {layer}; ") as err:
        vllm.update_weights(policy)
    assert "\n" not in str(err.value)
    assert any(name.startswith("model.layers.1.") for name in vllm_differences(vllm.llm, policy))  # stale there
    monkeypatch.setattr(vllm, "buckets", stream)
    vllm.update_weights(policy)  # a whole sync brings vLLM back
    assert not vllm_differences(vllm.llm, policy)


def test_a_model_vllm_cannot_serve_is_one_line_naming_the_fix(engines):
    # Head size 16: vLLM's CPU attention has no kernel for it.
    policy, vllm = engines("llama-tiny", model=(("hidden_size", 32), ("head_dim", 16)), check_sync=False)
    with pytest.raises(ConfigError, match="vLLM cannot serve this model .*use rollout.engine=auto") as err:
        vllm.update_weights(policy)  # vLLM starts at the first sync
    assert "\n" not in str(err.value)


def test_a_model_of_32_positions_starts_and_checks_its_sync(engines):
    # The sync probe was 32 tokens: vLLM refused it on such a model (prompt + 1 > 32) at start.
    policy, vllm = engines("llama-tiny", model=(("max_position_embeddings", 32),))
    completions = _synced_generate(vllm, policy, PROMPTS, _greedy(4)).token_ids
    assert len(completions) == len(PROMPTS) and len(vllm.probe) == 31
    assert vllm.last_sync_error is not None and vllm.last_sync_error <= 1e-5
