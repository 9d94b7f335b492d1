"""Multi-turn rollouts (trainer/rollout/drivers/multi_turn.py): exact token bookkeeping (sampled
tokens kept as drawn with loss_mask 1, environment turns from the chat template with 0), the engine's
recomputed log-probs equal the sampler's in both pad modes, one-line environment errors, and a
user environment from a test file training through polyfsdp-train."""
import math
import os

import pytest
import torch

from tests.helpers import HELPERS
from polyfsdp.trainer.data.batch import build_batch, per_sequence, response_mask
from polyfsdp.trainer.rollout.environments import EnvStep, parse_tool_calls
from polyfsdp.trainer.rollout.engines import Completions, RolloutEngine, SamplingParams
from polyfsdp.trainer.rollout.drivers.multi_turn import ChatTurns, MultiTurnDriver, MultiTurnSettings
from polyfsdp.trainer.errors import RewardError
from polyfsdp.trainer.rollout.row_seeds import turn_seed
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.rollout.tool_task import CalculatorEnv, calculate

GUESS_ENV = os.path.join(HELPERS, "envs", "guess_env.py") + ":GuessEnv"


class ScriptedEngine(RolloutEngine):
    """A rollout engine that answers each turn with the next scripted text (+ the last stop
    token: the chat template's end-of-turn token when it has one besides <eos>)."""

    name = "scripted"

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls, self.prompts, self.seeds = tokenizer, list(turns), 0, [], []

    def generate(self, prompts, params, seeds=None):
        self.prompts.append([list(p) for p in prompts])
        self.seeds.append(seeds)
        text = self.turns[self.calls]
        self.calls += 1
        out = [self.tokenizer.encode(text)[:params.max_new_tokens - 1] + [params.stop_token_ids[-1]]
               for _ in prompts]
        return Completions(out, [[-0.5] * len(o) for o in out])


def _params(tok, max_new_tokens, temperature=1.0, return_log_probs=False):
    """Sampling at ``temperature``, stopping at the tokenizer's <eos> (what a rollout asks)."""
    return SamplingParams.for_tokenizer(tok, max_new_tokens, temperature=temperature,
                                        return_log_probs=return_log_probs)


def _multi_turn(engine, env=GUESS_ENV, max_turns=4, max_total=None, **kwargs):
    return MultiTurnDriver(engine, MultiTurnSettings(env, kwargs, max_turns, max_total, False), max_positions=None)


def test_sampled_tokens_carry_loss_mask_1_and_environment_turns_0():
    tok = CharTokenizer()
    engine = ScriptedEngine(tok, ["a", "z", "e"])
    roll = _multi_turn(engine).rollout(tok, [Example("p", "")], 1, _params(tok, 8, return_log_probs=True))
    turns = ChatTurns(tok, None)
    prompt = turns.prompt([{"role": "user", "content": "guess a letter"}])
    a, z, e = ([*tok.encode(t), tok.eos_token_id] for t in "aze")
    higher = turns.after_assistant([{"role": "user", "content": "higher"}], True)
    lower = turns.after_assistant([{"role": "user", "content": "lower"}], True)
    assert roll.prompt_ids == [prompt]
    assert roll.response_ids == [a + higher + z + lower + e]
    assert roll.loss_masks == [[1] * len(a) + [0] * len(higher) + [1] * len(z) + [0] * len(lower) + [1] * len(e)]
    assert roll.log_probs == [[-0.5] * len(a) + [0.0] * len(higher) + [-0.5] * len(z) + [0.0] * len(lower)
                              + [-0.5] * len(e)]
    assert roll.rewards == [1.0] and roll.rollout_metrics["turns"] == [3.0]
    # Each turn's prompt is the conversation's tokens so far, exactly.
    assert engine.prompts[2] == [prompt + a + higher + z + lower]
    # The engine's response mask marks exactly the sampled tokens (position t predicts t + 1).
    mask = response_mask(*roll.pairs()[0])
    sampled = [i - 1 for i, m in enumerate([0] * len(prompt) + roll.loss_masks[0]) if m]
    assert mask.nonzero().flatten().tolist() == sampled


def test_turn_and_token_limits_end_a_conversation_and_count_it():
    tok = CharTokenizer()
    roll = _multi_turn(ScriptedEngine(tok, ["a", "b", "c", "d"]), max_turns=2).rollout(
        tok, [Example("p", "")], 2, _params(tok, 8))
    assert roll.rollout_metrics["turns"] == [2.0, 2.0] and roll.rewards == [0.0, 0.0]
    assert roll.rollout_metrics["truncated"] == [1.0, 1.0]  # the environment would have gone on
    assert roll.log_probs is None and roll.response_ids[0][-1] == tok.eos_token_id
    # A budget that fits the first turn only: the second would overflow, so the conversation ends.
    prompt_len = len(ChatTurns(tok, None).prompt([{"role": "user", "content": "guess a letter"}]))
    roll = _multi_turn(ScriptedEngine(tok, ["a", "b"]), max_total=prompt_len + 8 + 3).rollout(
        tok, [Example("p", "")], 1, _params(tok, 8))
    assert roll.rollout_metrics["turns"] == [1.0] and roll.rollout_metrics["truncated"] == [1.0]
    assert len(roll.prompt_ids[0]) + len(roll.response_ids[0]) <= prompt_len + 8 + 3


def test_each_turn_samples_with_its_conversations_turn_seeds():
    tok = CharTokenizer()
    engine = ScriptedEngine(tok, ["a", "b"])
    _multi_turn(engine, max_turns=2).rollout(tok, [Example("p", "")], 2, _params(tok, 8),
                                              row_seeds=[11, 12])
    assert engine.seeds == [[turn_seed(11, 1), turn_seed(12, 1)], [turn_seed(11, 2), turn_seed(12, 2)]]
    assert len({seed for turn in engine.seeds for seed in turn} | {11, 12}) == 6
    unseeded = ScriptedEngine(tok, ["a"])
    _multi_turn(unseeded, max_turns=1).rollout(tok, [Example("p", "")], 2, _params(tok, 8))
    assert unseeded.seeds == [None]


class _Raises:
    tools = []

    def reset(self, example):
        return [{"role": "user", "content": "x"}]

    def step(self, text):
        raise KeyError("boom")


class _Malformed(_Raises):
    def step(self, text):
        return EnvStep([{"role": "user"}], 0.0, False)


@pytest.mark.parametrize("env,expected", [(_Raises, f"step() raised KeyError: 'boom' at {__file__}:"),
                                          (_Malformed, "step() returned the message {'role': 'user'}")])
def test_a_failing_environment_is_one_line_naming_it_the_record_and_the_turn(env, expected, monkeypatch):
    import polyfsdp.trainer.rollout.drivers.multi_turn as multi_turn

    monkeypatch.setattr(multi_turn, "load_environment", lambda spec: env)
    tok = CharTokenizer()
    with pytest.raises(RewardError) as info:
        _multi_turn(ScriptedEngine(tok, ["a"]), env="mine").rollout(
            tok, [Example("p", "", where="r7")], 1, _params(tok, 8))
    assert expected in str(info.value) and "rollout.env=mine" in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).endswith("(record r7, turn 1)"), str(info.value)


def test_tool_calls_are_parsed_and_the_calculator_answers_them():
    text = 'x <tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call> ' \
           '<tool_call>not json</tool_call>'
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "17*23"}} and calls[1]["name"] is None
    assert calculate("17*23") == "391" and calculate("(1+2)/4") == "0.75"
    assert calculate("__import__('os')").startswith("error") and calculate("9**9**9").startswith("error")
    env = CalculatorEnv()
    env.reset(Example("what is 17*23?", "391"))
    step = env.step(text)
    assert [m["content"] for m in step.messages][0] == "391" and not step.done
    assert env.step("it is 391").reward == 1.0 and env.step("it is 390").reward == 0.0
    assert env.step("it is 3910").reward == 0.0  # the last number must be the answer, not contain it


@pytest.mark.parametrize("pad_mode", ["no_padding", "left_right"])
def test_recomputed_log_probs_of_multi_turn_trajectories_equal_the_samplers(pad_mode):
    from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
    from polyfsdp.engines.engine import FSDPEngine
    from polyfsdp.trainer.rollout.engines import PolicyDecoding

    tok = CharTokenizer()
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", vocab_size=tok.vocab_size),
                        EngineConfig(pad_mode=pad_mode, use_remove_padding=pad_mode == "no_padding"),
                        OptimConfig(lr=1e-3)).initialize()
    decoding = PolicyDecoding("builtin")
    decoding.update_weights(engine)
    rollout = _multi_turn(decoding, max_turns=3)
    torch.manual_seed(0)
    roll = rollout.rollout(tok, [Example("p", ""), Example("q", "")], 2, _params(tok, 6, 0.7, return_log_probs=True))
    assert any(0 in m for m in roll.loss_masks), "no environment turn happened: the test would prove nothing"
    batch = build_batch(roll.pairs(), pad_mode, tok.pad_token_id)
    out = engine.infer_batch(batch, temperature=0.7)
    for i, (prompt, response, loss_mask) in enumerate(roll.pairs()):
        recomputed = per_sequence(out["log_probs"], batch, pad_mode)[i]
        positions = [len(prompt) - 1 + k for k, m in enumerate(loss_mask) if m]
        expected = torch.tensor([lp for lp, m in zip(roll.log_probs[i], loss_mask) if m])
        torch.testing.assert_close(recomputed[positions].float(), expected, atol=1e-5, rtol=0)


def test_a_user_environment_from_a_test_file_trains_through_polyfsdp_train(tmp_path):
    from tests.cpu.trainer.test_cli import TINY, TINY_GRPO

    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    out = tmp_path / "run"
    # 30 SFT steps teach the tiny model to end its answers with <eos>, so conversations go on.
    code = main([*TINY, *TINY_GRPO, "trainer.sft_steps=30", "trainer.rl_steps=2", "trainer.plot=false",
                 "trainer.export=false", f"rollout.env={GUESS_ENV}", "rollout.max_turns=3",
                 "+rollout.env_kwargs.target=c", f"trainer.output_dir={out}"])
    assert code == 0
    grpo = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl" and "loss" in r]
    assert len(grpo) == 2 and all(r["multi_turn/turns_mean"] >= 1.0 for r in grpo)
    assert max(r["multi_turn/turns_mean"] for r in grpo) > 1.0  # some conversations had a second turn
    assert all(0.0 <= r["multi_turn/truncated_mean"] <= 1.0 for r in grpo)


def test_ppo_trains_a_critic_over_environment_turns_through_polyfsdp_train(tmp_path):
    """algo=ppo with an environment: GAE skips the environment's tokens (tests/cpu/trainer/algos/test_gae.py),
    the critic's value loss sees only the sampled ones."""
    from tests.cpu.trainer.test_cli import TINY, TINY_GRPO

    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    out = tmp_path / "run"
    code = main([*TINY, *TINY_GRPO, "algo=ppo", "algo.critic.critic_warmup=0", "trainer.sft_steps=30",
                 "trainer.rl_steps=2", "trainer.plot=false", "trainer.export=false", f"rollout.env={GUESS_ENV}",
                 "rollout.max_turns=3", "+rollout.env_kwargs.target=c", f"trainer.output_dir={out}"])
    assert code == 0
    rl = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl" and "loss" in r]
    assert len(rl) == 2 and max(r["multi_turn/turns_mean"] for r in rl) > 1.0  # environment turns happened
    for r in rl:
        assert all(math.isfinite(r[k]) for k in ("loss", "vf_loss", "vf_explained_var", "grad_norm")), r


class _Hangs(_Raises):
    def step(self, text):
        while True:
            pass


def test_an_environment_that_hangs_stops_after_env_timeout_s(monkeypatch):
    import polyfsdp.trainer.rollout.drivers.multi_turn as multi_turn

    monkeypatch.setattr(multi_turn, "load_environment", lambda spec: _Hangs)
    tok = CharTokenizer()
    rollout = MultiTurnDriver(ScriptedEngine(tok, ["a"]), MultiTurnSettings("mine", {}, 2, None, False, 0.5),
                              max_positions=None)
    with pytest.raises(RewardError, match=r"step\(\) took longer than rollout.env_timeout_s=0.5 s \(record r1, turn 1\)"):
        rollout.rollout(tok, [Example("p", "", where="r1")], 1, _params(tok, 8))


def test_resume_refuses_a_changed_environment(tmp_path, capsys):
    from tests.cpu.trainer.test_cli import TINY, TINY_GRPO

    from polyfsdp.trainer.train import main

    out = tmp_path / "run"
    base = [*TINY, *TINY_GRPO, "trainer.sft_steps=1", "trainer.rl_steps=1", "trainer.plot=false",
            "trainer.export=false", f"rollout.env={GUESS_ENV}", "rollout.max_turns=2", f"trainer.output_dir={out}"]
    assert main(base) == 0
    capsys.readouterr()
    assert main([*base, "rollout.max_turns=3", "trainer.rl_steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rollout.max_turns=2, but this run asks for rollout.max_turns=3" in err and "\n" not in err, err


def test_the_reward_named_in_the_first_line_is_the_environments():
    # With rollout.env the score is the environment's (reward.fn only with env_add_reward_fn):
    # polyfsdp-train's and polyfsdp-eval's first line must not name reward.fn alone.
    from polyfsdp.trainer.config.job import load_config

    def described(*overrides):
        return load_config(list(overrides)).rollout.describe_reward("char_match")

    assert described() == "char_match"
    assert described("rollout.env=calculator") == "environment calculator"
    assert described("rollout.env=calculator", "rollout.env_add_reward_fn=true") == "environment calculator + char_match"
