"""rollout.agent (trainer/rollout/drivers/agent.py): agents written with the openai client talk to
the rollout engine through the loopback endpoint, and their trajectories are the ones the
environment API records for the same conversation, token for token."""
import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("openai")

from tests.helpers import HELPERS, ROOT  # noqa: E402
from tests.cpu.trainer.rollout.test_multi_turn import GUESS_ENV, ScriptedEngine, _params  # noqa: E402

from polyfsdp.trainer.data.example import Example  # noqa: E402
from polyfsdp.trainer.data.tokenizers import CharTokenizer  # noqa: E402
from polyfsdp.trainer.errors import RewardError  # noqa: E402
from polyfsdp.trainer.rollout.drivers.agent import AgentDriver  # noqa: E402
from polyfsdp.trainer.rollout.drivers.result import Rollout  # noqa: E402
from polyfsdp.trainer.rollout.drivers.multi_turn import (MultiTurnDriver, MultiTurnSettings,  # noqa: E402
                                                         rollout_metrics)
from polyfsdp.trainer.rollout.tool_task import tool_call_text  # noqa: E402

AGENTS = os.path.join(HELPERS, "envs", "agents.py")
CALL = tool_call_text("calculator", {"expression": "17*23"})


def _tokenizer():
    tok = CharTokenizer()
    tok.add_chars(CALL)  # as data=calculator does: the call's "{} and _ are characters of the model
    return tok


def _settings(spec, max_turns=3, timeout_s=30.0):
    return MultiTurnSettings(spec, {}, max_turns, None, False, timeout_s)


def _agent(engine, name, concurrency=64, **kwargs):
    return AgentDriver(engine, _settings(f"{AGENTS}:{name}", **kwargs), None, concurrency)


def _same(a, b, atol=0.0):
    """The same training sequences: tokens, masks, rewards, and the sampler's log-probs (within
    ``atol``: a row sampled in another batch is computed with other float roundings)."""
    assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
    assert a.loss_masks == b.loss_masks and a.rewards == b.rewards
    assert (a.log_probs is None) == (b.log_probs is None)
    if a.log_probs is not None:
        assert max((abs(x - y) for p, q in zip(a.log_probs, b.log_probs) for x, y in zip(p, q)), default=0) <= atol


@pytest.mark.parametrize("name", ["calculator", "calculator_async", "calculator_streamed"])
def test_a_tool_calling_openai_agent_records_the_calculator_environments_sequence(name):
    tok = _tokenizer()
    examples = [Example("17*23", "391", where="r0"), Example("17*23", "390", where="r1")]
    params = _params(tok, 100, return_log_probs=True)
    env_engine = ScriptedEngine(tok, [CALL, "391"])
    env_roll = MultiTurnDriver(env_engine, _settings("calculator"), None).rollout(
        tok, examples, 2, params, row_seeds=[1, 2, 3, 4])
    engine = ScriptedEngine(tok, [CALL, "391"])
    driver = _agent(engine, name)
    try:
        roll = driver.rollout(tok, examples, 2, params, row_seeds=[1, 2, 3, 4])
    finally:
        driver.close()
    assert 0 in roll.loss_masks[0], "no tool turn happened: the test would prove nothing"
    _same(roll, env_roll)
    assert roll.rewards == [1.0, 1.0, 0.0, 0.0] and roll.rollout_metrics["tool_calls"] == [1.0] * 4
    assert roll.rollout_metrics["agent/retokenization_mismatch"] == [0.0] * 4
    assert engine.seeds == env_engine.seeds and engine.prompts == env_engine.prompts  # each turn's rows and seeds


def _policy(tok):
    from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
    from polyfsdp.engines.engine import FSDPEngine

    torch.manual_seed(0)
    return FSDPEngine(ModelConfig(preset="qwen2-tiny", vocab_size=tok.vocab_size), EngineConfig(),
                      OptimConfig(lr=1e-3)).initialize()


def _letter_stops(tok, max_new_tokens=4):
    """Sampling that ends a turn at any letter too: the untrained model's turns end early, so its
    conversations with GuessEnv go on for several turns."""
    base = _params(tok, max_new_tokens, 1.0, return_log_probs=True)
    return replace(base, stop_token_ids=(*tok.encode("abcdefghijklmnopqrstuvwxyz"), *base.stop_token_ids))


def agents_agree_with_the_environment_api_and_the_decoding_loop(engine, builtin, tok):
    """rollout.agent over ``engine`` (the vLLM and server tests call this with theirs): the chat
    agent records what the environment API records through the same engine (sampled rows, per-row
    seeds); the completions agent, greedy, what it records through our decoding loop ``builtin``
    (the same policy; log-probs to 1e-5). Every token stops a turn, so every conversation has
    several turns."""
    from contextlib import closing

    examples, seeds = [Example("p", "", where="r0"), Example("q", "", where="r1")], [5, 6, 7, 8]
    params = replace(_params(tok, 4, return_log_probs=True), stop_token_ids=tuple(range(tok.vocab_size)))
    env_roll = MultiTurnDriver(engine, _settings(GUESS_ENV), None).rollout(tok, examples, 2, params, row_seeds=seeds)
    assert all(0 in m for m in env_roll.loss_masks), "a conversation of one turn: the test would prove less"
    greedy = replace(params, greedy=True)
    with closing(_agent(engine, "guess")) as chat, closing(_agent(engine, "guess_text")) as text, \
            closing(_agent(builtin, "guess_text")) as reference:
        _same(chat.rollout(tok, examples, 2, params, row_seeds=seeds), env_roll)
        ours = text.rollout(tok, examples, 2, greedy, row_seeds=seeds)
        _same(ours, reference.rollout(tok, examples, 2, greedy, row_seeds=seeds), atol=1e-5)
    assert all(0 in m for m in ours.loss_masks)


@pytest.fixture(scope="module")
def policy():
    tok = _tokenizer()
    return tok, _policy(tok)


@pytest.mark.parametrize("engine_name", ["builtin", "hf"])
def test_an_agent_samples_what_the_environment_api_samples_with_every_engine(policy, engine_name):
    from polyfsdp.trainer.rollout.engines import PolicyDecoding

    tok, model = policy
    engine = PolicyDecoding(engine_name)
    engine.update_weights(model)
    examples, seeds = [Example("p", "", where="r0"), Example("q", "", where="r1")], [5, 6, 7, 8, 9, 10]
    params = _letter_stops(tok)
    env_roll = MultiTurnDriver(engine, _settings(GUESS_ENV), None).rollout(tok, examples, 3, params,
                                                                          row_seeds=seeds)
    assert any(0 in m for m in env_roll.loss_masks), "no second turn: the test would prove nothing"
    driver = _agent(engine, "guess")
    try:
        _same(driver.rollout(tok, examples, 3, params, row_seeds=seeds), env_roll)
        # The calculator agent too (the untrained model rarely calls the tool; one turn each).
        env_calc = MultiTurnDriver(engine, _settings("calculator"), None).rollout(tok, examples, 2, params,
                                                                                   row_seeds=seeds[:4])
        calc = _agent(engine, "calculator")
        try:
            _same(calc.rollout(tok, examples, 2, params, row_seeds=seeds[:4]), env_calc)
        finally:
            calc.close()
    finally:
        driver.close()


def _guessing(tok, *agents):
    """Each agent's rollout of one conversation whose turns are " a ", "z", "e" (with <eos>), and
    the last one's engine (to read the contexts it was given)."""
    rolls = []
    for name in agents:
        engine = ScriptedEngine(tok, [" a ", "z", "e"])
        driver = _agent(engine, name, max_turns=4)
        try:
            rolls.append(driver.rollout(tok, [Example("p", "")], 1, _params(tok, 8, return_log_probs=True)))
        finally:
            driver.close()
    return (*rolls, engine)


def test_an_agent_that_edits_its_history_is_counted_and_trained_on_the_sampled_tokens():
    tok = _tokenizer()
    expected, roll, _ = _guessing(tok, "guess", "guess_editing")
    assert expected.rollout_metrics["agent/retokenization_mismatch"] == [0.0]
    assert roll.rollout_metrics["agent/retokenization_mismatch"] == [1.0]
    _same(roll, expected)  # the sampled " a " is trained, not the agent's "a."
    assert tok.encode(" a ") == roll.response_ids[0][:3] and roll.rewards == [1.0]
    assert rollout_metrics(roll.rollout_metrics)["agent/retokenization_mismatch"] == 1.0


def test_a_conversation_cut_by_a_limit_is_counted_and_its_agent_told_which(caplog):
    import logging
    import time

    tok = _tokenizer()
    driver = _agent(ScriptedEngine(tok, [" a ", "z", " a ", "z"]), "guess_noting", max_turns=2)
    try:
        with caplog.at_level(logging.WARNING):
            rolls = [driver.rollout(tok, [Example("p", "", where=f"r{i}")], 1, _params(tok, 8)) for i in range(2)]
    finally:
        driver.close()
    assert [r.rollout_metrics["truncated"] for r in rolls] == [[1.0], [1.0]] and rolls[0].rewards == [0.0]
    warned = [r.message for r in caplog.records if "asked the model again" in r.message]
    assert warned == [f"rollout.agent={AGENTS}:guess_noting: 1 of 1 conversations asked the model again after "
                      f"rollout.max_turns=2 turns and were cut (rewarded 0); raise rollout.max_turns if the agent "
                      f"needs more turns"]  # once a run
    notes = driver.agent.__globals__["NOTES"]  # the agents file as the driver loaded it
    for _ in range(50):
        if "r1" in notes:
            break
        time.sleep(0.1)
    assert "polyfsdp ended the conversation (rollout.max_turns=2 reached); it is rewarded 0" in notes["r0"], notes


def test_the_other_numbers_an_agent_returns_are_logged_as_agent_metrics():
    tok = _tokenizer()
    roll, _ = _guessing(tok, "guess_reporting")
    assert roll.rewards == [1.0] and roll.rollout_metrics["agent/turns_taken"] == [3.0]
    assert not {"agent/note", "agent/flag", "agent/reward"} & set(roll.rollout_metrics)
    assert rollout_metrics(roll.rollout_metrics)["agent/turns_taken"] == 3.0


def test_a_completions_agent_records_its_texts_tokens_after_the_sampled_ones():
    """/v1/completions: the prompt is <bos> and its text, each sampled completion is kept as drawn
    (its stop token too) and what the agent adds to its prompt follows as plain text, masked; an
    agent that rewrites a completion is counted and trained on the sampled tokens."""
    tok = _tokenizer()
    edited, roll, engine = _guessing(tok, "guess_text_editing", "guess_text")
    enc, eos = tok.encode, [tok.eos_token_id]
    assert roll.prompt_ids == [[tok.bos_token_id] + enc("guess a letter: ")]
    turns = [(enc(" a ") + eos, 1), (enc(" higher: "), 0), (enc("z") + eos, 1), (enc(" lower: "), 0),
             (enc("e") + eos, 1)]
    assert roll.response_ids == [[t for part, _ in turns for t in part]]
    assert roll.loss_masks == [[m for part, m in turns for _ in part]] and roll.rewards == [1.0]
    assert engine.prompts[1] == [roll.prompt_ids[0] + roll.response_ids[0][:len(turns[0][0]) + len(turns[1][0])]]
    assert roll.rollout_metrics["agent/retokenization_mismatch"] == [0.0]
    # The rewritten " a " -> "a.": the sampled tokens stay, what follows the shared text is the turn.
    assert edited.rollout_metrics["agent/retokenization_mismatch"] == [1.0]
    assert edited.response_ids[0][:4] == enc(" a ") + eos and edited.loss_masks[0][:4] == [1] * 4
    assert tok.decode(edited.response_ids[0][4:4 + len("a. higher: ")]) == "a. higher: " and edited.rewards == [1.0]


def test_a_streamed_answer_is_the_whole_answer_as_events():
    """stream=true (chat and completions): the agents read the same texts, so they record the same
    conversations as their non-streamed twins."""
    tok = _tokenizer()
    chat, streamed_chat, text, streamed_text, _ = _guessing(tok, "guess", "guess_streamed", "guess_text",
                                                            "guess_text_streamed")
    _same(streamed_chat, chat)
    _same(streamed_text, text)
    assert 0 in chat.loss_masks[0] and 0 in text.loss_masks[0] and chat.rewards == text.rewards == [1.0]


def test_64_concurrent_conversations_sample_what_one_at_a_time_samples(policy):
    from polyfsdp.trainer.rollout.engines import PolicyDecoding

    tok, model = policy
    engine = PolicyDecoding("builtin")
    engine.update_weights(model)
    examples = [Example(f"p{i}", "", where=f"r{i}") for i in range(64)]
    params, seeds = _letter_stops(tok, 3), list(range(100, 164))
    together, alone = _agent(engine, "guess", max_turns=2), _agent(engine, "guess", concurrency=1, max_turns=2)
    try:
        many = together.rollout(tok, examples, 1, params, row_seeds=seeds)
        # Every 4th row alone (rollout.agent_concurrency=1: one conversation per round), to save time.
        single = alone.rollout(tok, examples[::4], 1, params, row_seeds=seeds[::4])
    finally:
        together.close()
        alone.close()
    assert any(0 in m for m in many.loss_masks) and len(set(map(tuple, many.response_ids))) > 8
    every_4th = Rollout(*(getattr(many, f)[::4] for f in ("prompt_ids", "response_ids", "texts", "rewards")),
                        log_probs=many.log_probs[::4], loss_masks=many.loss_masks[::4])
    _same(every_4th, single, atol=1e-5)


@pytest.mark.parametrize("name,turn,expected", [
    ("raises", 1, "raised KeyError: 'boom' at "),
    ("hangs", 1, "neither called the model nor returned within rollout.env_timeout_s=5 s"),
    ("never_calls", 0, "returned 1.0 before calling the model"),
    ("asks_two_choices", 0, "sent a request the endpoint cannot serve (chat completion request: n=2"),
    ("embeddings", 0, "sent a request the endpoint cannot serve (POST /v1/embeddings: not served"),
    ("token_prompt", 0, "(completion request: 'prompt' must be one string (got list)"),
    ("switches_kind", 1, "sent a chat request in a conversation it began with completions requests"),
    ("malformed_body", 0, "sent a request the endpoint cannot serve (the request body is not JSON"),
    ("returns_text", 1, "returned 'great'; expected a finite number"),
])
def test_each_agent_failure_is_one_line_naming_the_agent_the_record_and_the_turn(name, turn, expected):
    tok = _tokenizer()
    # 5 s, not less: on a loaded CI machine an agent's first request (its client built on a new
    # thread) once took over 0.5 s, and 'hangs' was reported at turn 0 instead of turn 1.
    driver = _agent(ScriptedEngine(tok, ["a", "b"]), name, timeout_s=5.0)
    try:
        with pytest.raises(RewardError) as info:
            driver.rollout(tok, [Example("p", "", where="r7")], 1, _params(tok, 8))
    finally:
        driver.close()
    line = str(info.value)
    assert f"rollout.agent={AGENTS}:{name} " in line and expected in line and "\n" not in line, line
    assert line.endswith(f"(record r7, turn {turn})"), line




def test_the_verifiers_shaped_example_records_the_calculator_environments_sequence():
    tok = _tokenizer()
    examples, params = [Example("17*23", "391", where="r0")], _params(tok, 100, return_log_probs=True)
    env_roll = MultiTurnDriver(ScriptedEngine(tok, [CALL, "391"]), _settings("calculator"), None).rollout(
        tok, examples, 2, params, row_seeds=[1, 2])
    driver = AgentDriver(ScriptedEngine(tok, [CALL, "391"]),
                         _settings(os.path.join(ROOT, "examples", "verifiers_style_agent.py:agent")), None)
    try:
        roll = driver.rollout(tok, examples, 2, params, row_seeds=[1, 2])
    finally:
        driver.close()
    _same(roll, env_roll)
    assert roll.rewards == [1.0, 1.0] and 0 in roll.loss_masks[0]


def test_the_docs_agent_trains_through_polyfsdp_train(tmp_path):
    import re

    from tests.cpu.trainer.test_cli import TINY

    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    page = open(os.path.join(ROOT, "docs", "multi-turn.md")).read()
    (tmp_path / "my_agent.py").write_text(re.findall(r"```python my_agent.py\n(.*?)```", page, flags=re.S)[0])
    out = tmp_path / "run"
    code = main([*TINY, "algo.actor.group_size=2", "trainer.sft_steps=0", "trainer.rl_steps=1", "trainer.plot=false",
                 "trainer.export=false", "trainer.eval_interval=0", "eval.initial=false", "data=arith_words",
                 "algo.actor.max_new_tokens=8", f"rollout.agent={tmp_path / 'my_agent.py'}:agent",
                 "rollout.max_turns=2", f"trainer.output_dir={out}"])
    assert code == 0
    grpo = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl" and "loss" in r]
    assert len(grpo) == 1 and grpo[0]["agent/retokenization_mismatch"] == 0.0
    assert grpo[0]["multi_turn/turns_mean"] >= 1.0


def test_agent_settings_are_checked_before_any_model_is_built(monkeypatch):
    import sys

    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.errors import ConfigError

    agent = f"rollout.agent={AGENTS}:guess"
    assert load_config([agent, "rollout.max_turns=3"]).rollout.agent == f"{AGENTS}:guess"
    with pytest.raises(ConfigError, match="rollout.env=calculator and rollout.agent=.*: set one"):
        load_config([agent, "rollout.env=calculator"])
    with pytest.raises(ConfigError, match="rollout.agent_concurrency: expected at least 1"):
        load_config([agent, "rollout.agent_concurrency=0"])
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_config([f"rollout.agent={AGENTS}:nope"])
    with pytest.raises(ConfigError, match=r"one_argument\(example\) cannot be called as fn\(example, client\) "):
        load_config([f"rollout.agent={AGENTS}:one_argument"])
    with pytest.raises(ConfigError) as info:
        load_config([f"rollout.agent={AGENTS}"])
    assert str(info.value) == (f"rollout.agent={AGENTS}: expected path/to/file.py:function or package.module:function "
                               f"(the function after a colon: {AGENTS}:name)")
    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        load_config([agent])
    assert str(info.value) == "rollout.agent needs the openai package for its client: pip install openai"
