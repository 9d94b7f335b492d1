"""``rollout.engine=vllm_server`` (trainer/rollout/servers/engine.py) against independent
references, with real vLLM OpenAI servers started by polyfsdp and weights pushed over the CPU
weight-transfer backend (vLLM's own HTTP routes): greedy completions equal our decoding loop's;
sampled rows draw the same tokens from 1 server and from 2 for the same row seeds; after every
GRPO step the servers' log-probs of the tokens they sampled equal the trainer's (a policy with
tied embeddings, then a LoRA policy, through the same servers); a multi-turn environment runs
through the driver as with the decoding loop; a bucket left out of a sync stops the run, naming
the layers it left without weights, and the servers log no noise about loading; a server that dies
or cannot be reached is one line naming it. Two engines (1 and 2 servers) for the whole module:
a server starts in ~30 s."""
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.trainer.algos.rl_step import RLContext, StepSeeds, rl_step
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.task import ReverseTask
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.rollout.build import build_rollout_driver, build_rollout_engine
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver
from polyfsdp.trainer.rollout.engines import PolicyDecoding, SamplingParams
from polyfsdp.trainer.rollout.row_seeds import RowSeeds
from polyfsdp.trainer.rollout.servers.completions import completion_request
from polyfsdp.trainer.rollout.servers.http import ServerHttp
from tests.helpers.vllm_cases import require_vllm, write_checkpoint
from tests.helpers.vllm_server import free_port

TOK = CharTokenizer()
PROMPTS = [[TOK.bos_token_id] + TOK.encode(s) for s in ("abc=", "ba=", "hgfe=", "a=", "dcba+ab=")]


def _policy(directory, seed, **model):
    lora = model.pop("lora", None)
    path = write_checkpoint(directory, "qwen2-tiny", TOK, seed=seed, **model)
    return FSDPEngine(ModelConfig(path=path, lora=lora), EngineConfig(), OptimConfig(lr=1e-2)).initialize()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``count -> engine`` on ``count`` started servers (built on first use, closed at the end)."""
    require_vllm()
    built = {}

    def get(count):
        if count not in built:
            section = RolloutSection(engine="vllm_server", check_sync_tol=1e-5, sync_bucket_mb=0.01,
                                     server={"count": count}, vllm={"kv_cache_mb": 64})
            built[count] = build_rollout_engine(section, get_backend(),
                                                log_dir=str(tmp_path_factory.mktemp(f"logs{count}")))
        return built[count]

    yield get
    for engine in built.values():
        engine.close()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return _policy(tmp_path_factory.mktemp("policy"), seed=3)


def _params(max_new_tokens, eos=TOK.eos_token_id, **options):
    return SamplingParams(max_new_tokens, stop_token_ids=(eos,), pad_token_id=TOK.pad_token_id, **options)


def test_greedy_completions_equal_the_builtin_loop(servers, policy):
    engine = servers(1)
    builtin = PolicyDecoding("builtin")
    builtin.update_weights(policy)
    free = builtin.generate(PROMPTS, _params(12, greedy=True)).token_ids
    counts = {}
    for row in free:
        for tok in set(row[1:-1]):
            counts[tok] = counts.get(tok, 0) + 1
    eos = min(t for t, c in counts.items() if 0 < c < len(free))  # ends some rows early, not others
    ours = builtin.generate(PROMPTS, _params(12, eos, greedy=True, return_log_probs=True))
    engine.update_weights(policy)
    theirs = engine.generate(PROMPTS, _params(12, eos, greedy=True, return_log_probs=True))
    assert theirs.token_ids == ours.token_ids
    ended = [row for row in ours.token_ids if row[-1] == eos]
    assert ended and len(ended) < len(PROMPTS)  # the stop token is kept, as our loop keeps it
    assert max(abs(a - b) for x, y in zip(ours.log_probs, theirs.log_probs) for a, b in zip(x, y)) < 1e-5
    assert engine.last_sync_error < 1e-5 and engine.weight_version == 1


def test_the_request_carries_the_sampling_controls_and_leaves_stop_strings_to_the_engine():
    params = _params(5, temperature=0.7, top_p=0.9, top_k=7, repetition_penalty=1.2, stop=("xy",),
                     detokenize=TOK.decode)
    body = completion_request("m", [1, 2], params, seed=3)
    assert (body["top_p"], body["top_k"], body["repetition_penalty"], body["temperature"]) == (0.9, 7, 1.2, 0.7)
    assert "stop" not in body  # the servers have no tokenizer (--skip-tokenizer-init): the engine cuts


def test_greedy_with_a_repetition_penalty_and_a_stop_string_equals_the_builtin_loop(servers, policy):
    engine = servers(1)
    builtin = PolicyDecoding("builtin")
    builtin.update_weights(policy)
    penalized = _params(12, greedy=True, return_log_probs=True, repetition_penalty=1.8)
    ours = builtin.generate(PROMPTS, penalized)
    assert ours.token_ids != builtin.generate(PROMPTS, _params(12, greedy=True)).token_ids
    engine.update_weights(policy)
    theirs = engine.generate(PROMPTS, penalized)
    assert theirs.token_ids == ours.token_ids
    assert max(abs(a - b) for x, y in zip(ours.log_probs, theirs.log_probs) for a, b in zip(x, y)) < 1e-5
    stopped = _params(12, greedy=True, repetition_penalty=1.8, stop=(TOK.decode(ours.token_ids[0])[3:5],),
                      detokenize=TOK.decode)
    cut = builtin.generate(PROMPTS, stopped).token_ids
    assert cut[0] != ours.token_ids[0] and engine.generate(PROMPTS, stopped).token_ids == cut


def test_sampled_rows_draw_the_same_tokens_from_one_server_and_from_two(servers, policy):
    prompts = PROMPTS * 3
    seeds = RowSeeds(4, 1).rows(0, len(prompts), 1)
    params = _params(6, temperature=1.0, return_log_probs=True)
    one, two = servers(1), servers(2)
    one.update_weights(policy)
    two.update_weights(policy)
    a, b = one.generate(prompts, params, seeds), two.generate(prompts, params, seeds)
    assert len(set(map(tuple, a.token_ids))) > len(PROMPTS)  # sampled: a prompt's rows differ
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for p, q in zip(a.log_probs, b.log_probs) for x, y in zip(p, q)) < 1e-5


def _grpo():
    cfg = load_config(["algo.rollout_correction.report_mismatch=true", "algo.actor.group_size=4",
                       "trainer.prompts_per_step=4", "algo.actor.kl_coef=0", "algo.actor.temperature=0.8",
                       "algo.actor.optim.lr=1e-2"])
    task = ReverseTask()
    examples = [[task.sample(random.Random(100 * step + i)) for i in range(4)] for step in range(3)]
    return cfg.algo, cfg.algo.actor_loss(4), examples


@pytest.mark.parametrize("kind", ["tied", "lora"])
def test_sampled_log_probs_match_the_policy_after_every_rl_step(servers, tmp_path, kind):
    """A new policy on servers that served another: the first sync pushes it whole; every later
    one after an optimizer step (a layer per bucket; LoRA merged into the weights it serves)."""
    if kind == "lora":
        pytest.importorskip("peft")
    algo, loss, examples = _grpo()
    engine = servers(2)
    model = {"tie_word_embeddings": True} if kind == "tied" else {"lora": {"rank": 4, "alpha": 8}}
    policy = _policy(tmp_path, seed=5 if kind == "tied" else 7, **model)
    start = engine.weight_version
    for step, batch in enumerate(examples):
        metrics = rl_step(RLContext(policy, TOK, algo, loss, driver=SingleTurnDriver(engine)), batch, StepSeeds(step))
        # The loss compares the servers' log-probs with the policy's own, before this step's update.
        assert metrics["rollout_mismatch_abs_max"] < 1e-5, (step, metrics["rollout_mismatch_abs_max"])
        assert engine.weight_version == start + step + 1
    assert engine.last_sync_bytes > 0


def test_a_multi_turn_environment_runs_through_the_driver_as_with_our_loop(servers, policy):
    """Greedy (sampled rows are drawn by different generators in the two engines); the stop token
    is one the model emits often, so turns end and the environment answers."""
    from tests.cpu.trainer.rollout.test_multi_turn import GUESS_ENV

    builtin = PolicyDecoding("builtin")
    builtin.update_weights(policy)
    counts = {}
    for row in builtin.generate(PROMPTS, _params(12, greedy=True)).token_ids:
        for tok in row:
            counts[tok] = counts.get(tok, 0) + 1
    tok = CharTokenizer()
    tok.eos_token_id = max(counts, key=counts.get)
    section = RolloutSection(env=GUESS_ENV, max_turns=3)
    examples = [Example("p", ""), Example("q", "")]
    params = SamplingParams(6, greedy=True, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                            return_log_probs=True)
    engine = servers(1)
    engine.update_weights(policy)
    theirs = build_rollout_driver(section, engine).rollout(tok, examples, 2, params)
    ours = build_rollout_driver(section, builtin).rollout(tok, examples, 2, params)
    assert theirs.response_ids == ours.response_ids and theirs.loss_masks == ours.loss_masks
    assert theirs.rewards == ours.rewards and max(theirs.rollout_metrics["turns"]) > 1
    flat = lambda r: [x for row in r.log_probs for x in row]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(flat(theirs), flat(ours))) < 1e-5


def test_agents_sample_through_the_servers_what_the_environment_api_and_our_loop_sample(servers, policy):
    pytest.importorskip("openai")
    from tests.cpu.trainer.rollout.test_agent_endpoint import agents_agree_with_the_environment_api_and_the_decoding_loop

    builtin, engine = PolicyDecoding("builtin"), servers(1)
    builtin.update_weights(policy)
    engine.update_weights(policy)
    agents_agree_with_the_environment_api_and_the_decoding_loop(engine, builtin, TOK)


def test_a_judge_served_by_vllm_gives_our_greedy_loops_verdicts(tmp_path):
    """reward.judge.checkpoint: polyfsdp starts a vLLM server that reads the checkpoint's tokenizer;
    its verdicts (plain-text completions, greedy) are our decoding loop's greedy completions of the
    same prompts, and the scores are those verdicts parsed."""
    from polyfsdp.trainer.rewards.judge import build_judge, parse_verdict

    require_vllm()
    directory = write_checkpoint(tmp_path / "judge", "qwen2-tiny", TOK, seed=5)
    TOK.save_pretrained(directory)
    section = {"checkpoint": directory, "api": "completions", "template": "{prompt}={response}:", "max_tokens": 6,
               "parse": "regex", "pattern": r"(\d)"}
    examples, texts = [Example("ab", "ba", where="r0"), Example("abc", "cba", where="r1")], ["ba", "xy", "cba", "c"]
    judge = build_judge(section, get_backend(), log_dir=str(tmp_path))
    try:
        verdicts = [judge.verdict(examples[i // 2], text) for i, text in enumerate(texts)]
        rewards, extras = judge.score_all(examples, texts, [[]] * 4, group=2)
    finally:
        judge.close()
    assert judge.server.process is None  # stopped
    builtin = PolicyDecoding("builtin")
    builtin.update_weights(FSDPEngine(ModelConfig(path=directory), EngineConfig(), OptimConfig()).initialize())
    prompts = [[TOK.bos_token_id] + TOK.encode(f"{examples[i // 2].prompt}={t}:") for i, t in enumerate(texts)]
    ours = [TOK.decode(row) for row in builtin.generate(prompts, _params(6, greedy=True)).token_ids]
    assert verdicts == ours and len(set(ours)) > 1, ours
    parsed = [parse_verdict(v, judge.settings) for v in ours]
    assert rewards == [0.0 if p is None else p for p in parsed]
    assert extras["judge_unparsable"] == [float(p is None) for p in parsed]


def test_a_bucket_left_out_of_the_sync_stops_the_run(servers, policy, monkeypatch):
    engine = servers(1)
    engine.update_weights(policy)
    stream = engine.buckets

    def without_layer_one(module, bucket_bytes, untie):
        for bucket in stream(module, bucket_bytes, untie):
            if not any(".layers.1." in name for name, _ in bucket):
                yield bucket

    monkeypatch.setattr(engine, "buckets", without_layer_one)
    policy.weights_version += 1  # what an optimizer step does; the weights move below
    for param in policy.module.parameters():
        param.data.mul_(0.9)
    # The server's workers find it, before the probe check: the sync fails, naming the layers.
    refused = r"rollout server 0 \(.*\) POST /update_weights: .*6 of vLLM's layers got none or only part of their " \
              r"weights: model.layers.1.self_attn.qkv_proj \(0 of"
    with pytest.raises(ConfigError, match=refused) as err:
        engine.update_weights(policy)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(engine, "buckets", stream)
    engine.sender.close()  # a failed push leaves the transfer group out of step: a new one
    engine.sender.init()
    policy.weights_version += 1
    engine.update_weights(policy)  # a whole sync brings the server back (the failed one left no update open)
    assert engine.last_sync_error < 1e-5
    # Neither the start nor a sync logged vLLM's warning per layer left without weights (unnamed; the
    # rotary cache's on every sync) or a traceback for its chat-template warmup without a tokenizer.
    with open(engine.processes[0].log_path, errors="replace") as log:
        logged = log.read()
    assert "Failed to load weights" not in logged and "Chat template warmup failed" not in logged


def test_a_server_started_by_hand_with_the_launcher_takes_the_policy_at_the_first_sync(tmp_path):
    """rollout.server.urls (the two-node recipe): a server from another checkpoint of the same
    architecture, started with ``python -m polyfsdp.trainer.rollout.servers.launch``; the first sync
    pushes the policy over the transfer group, and its greedy rows are then our loop's. Both tie
    their embeddings, as SmolLM2 does (the head follows the pushed input embedding)."""
    require_vllm()
    policy = _policy(tmp_path / "policy", seed=5, tie_word_embeddings=True)
    other = write_checkpoint(tmp_path / "other", "qwen2-tiny", TOK, seed=11, tie_word_embeddings=True)
    port = free_port()
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "polyfsdp.trainer.rollout.servers.launch", "--model", other,
                                   "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
                                   "--kv-cache-mb", "64"], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    engine = build_rollout_engine(RolloutSection(engine="vllm_server", check_sync_tol=1e-5,
                                                 server={"urls": [f"http://127.0.0.1:{port}"]}), get_backend())
    try:
        deadline = time.monotonic() + 300
        while not ServerHttp(f"http://127.0.0.1:{port}", "s", 5).healthy():
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-2000:]
            time.sleep(1)
        engine.update_weights(policy)
        assert engine.last_sync_error < 1e-5 and engine.last_sync_bytes > 0 and engine.model == "polyfsdp-policy"
        builtin = PolicyDecoding("builtin")
        builtin.update_weights(policy)
        params = _params(8, greedy=True)
        assert engine.generate(PROMPTS, params).token_ids == builtin.generate(PROMPTS, params).token_ids
    finally:
        engine.close()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_a_server_that_cannot_be_reached_is_one_line_naming_it(policy):
    url = f"http://127.0.0.1:{free_port()}"
    engine = build_rollout_engine(RolloutSection(engine="vllm_server", server={"urls": [url],
                                                                                "request_timeout_s": 10}),
                                  get_backend())
    try:
        with pytest.raises(ConfigError) as err:
            engine.update_weights(policy)
    finally:
        engine.close()
    assert url in str(err.value) and "rollout server 0" in str(err.value) and "\n" not in str(err.value)


def test_a_server_that_died_is_one_line_naming_it_and_its_log(servers, policy):
    """Last: it ends a server of the two-server engine."""
    engine = servers(2)
    engine.update_weights(policy)
    victim = engine.processes[1]
    victim.stop()
    with pytest.raises(ConfigError) as err:
        engine.generate(PROMPTS, _params(3, greedy=True))
    message = str(err.value)
    assert "rollout server 1" in message and victim.log_path in message and "\n" not in message
