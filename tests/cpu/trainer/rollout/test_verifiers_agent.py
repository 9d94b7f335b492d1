"""rollout.agent=verifiers:ENV_ID (trainer/rollout/drivers/verifiers_agent.py): a verifiers (0.4)
environment's episodes run against polyfsdp's agent endpoint, its rubric is the reward, its tasks
are the data (data=verifiers). The environment is tests/helpers/envs/vf_tiny_sums.py, built in code."""
import os
import sys

import pytest

pytest.importorskip("verifiers.v1")

from tests.helpers import HELPERS  # noqa: E402
from tests.cpu.trainer.rollout.test_agent_endpoint import _same, _settings  # noqa: E402
from tests.cpu.trainer.rollout.test_multi_turn import ScriptedEngine, _params  # noqa: E402

from polyfsdp.trainer.data.tokenizers import CharTokenizer  # noqa: E402
from polyfsdp.trainer.errors import ConfigError  # noqa: E402
from polyfsdp.trainer.rollout.drivers.agent import AgentDriver  # noqa: E402
from polyfsdp.trainer.rollout.drivers.verifiers_agent import verifiers_environment  # noqa: E402

ENVS = os.path.join(HELPERS, "envs")
SPEC = "verifiers:vf-tiny-sums"
KWARGS = {"taskset": {"count": 3, "system_prompt_text": "Add."}}


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    """vf_tiny_sums importable by its taskset id, as its installed package would be."""
    monkeypatch.syspath_prepend(ENVS)


def _rollout(spec, kwargs, examples, replies):
    tok = CharTokenizer()
    tok.add_chars("Add.")
    settings = _settings(spec)
    settings.env_kwargs = dict(kwargs)
    driver = AgentDriver(ScriptedEngine(tok, replies), settings, None)
    try:
        return driver.rollout(tok, examples, 2, _params(tok, 8, return_log_probs=True), row_seeds=[1, 2, 3, 4, 5, 6])
    finally:
        driver.close()


def test_a_verifiers_episode_records_the_plain_agents_sequence_and_its_rubric_is_the_reward():
    examples = verifiers_environment(SPEC, KWARGS).examples()
    assert [e.messages for e in examples] == [({"role": "system", "content": "Add."},
                                               {"role": "user", "content": p}) for p in ("2+3=", "4+4=", "1+6=")]
    assert [e.answer for e in examples] == ["5", "8", "7"]
    roll = _rollout(SPEC, KWARGS, examples, ["5"])
    plain = _rollout(os.path.join(ENVS, "vf_tiny_sums.py:plain_agent"), {}, examples, ["5"])
    _same(roll, plain)  # tokens, masks, log-probs, and the rubric's reward equals the plain agent's
    # @vf.reward correct (1 when the reply is the answer) + @vf.reward(weight=0.5) short.
    assert roll.rewards == [1.5, 1.5, 0.5, 0.5, 0.5, 0.5]
    assert roll.rollout_metrics["agent/retokenization_mismatch"] == [0.0] * 6
    # Each reward function's own score (before its weight) is logged beside the sum.
    assert roll.rollout_metrics["agent/reward_correct"] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert roll.rollout_metrics["agent/reward_short"] == [1.0] * 6


def test_a_failed_episode_is_one_line_naming_its_error_and_the_record():
    from polyfsdp.trainer.errors import RewardError

    kwargs = {"taskset": {"count": 1, "broken": True}}
    with pytest.raises(RewardError) as info:
        _rollout(SPEC, kwargs, verifiers_environment(SPEC, kwargs).examples(), ["5"])
    assert str(info.value) == ("rollout.agent=verifiers:vf-tiny-sums raised RuntimeError: the verifiers episode "
                               "failed: TaskError: task SumTask scoring: KeyError: 'no rubric today' "
                               "(record verifiers:vf-tiny-sums task 0, turn 1)")


def test_a_tiny_grpo_job_trains_on_a_verifiers_environment(tmp_path):
    from tests.cpu.trainer.test_cli import TINY

    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    out = tmp_path / "run"
    code = main([*TINY, "algo.actor.group_size=2", "trainer.sft_steps=0", "trainer.rl_steps=2", "trainer.plot=false",
                 "trainer.export=false", "trainer.eval_interval=0", "eval.initial=false", "data=verifiers",
                 "data.eval_size=2", "algo.actor.max_new_tokens=2", f"rollout.agent={SPEC}",
                 "+rollout.env_kwargs.taskset.count=8", f"trainer.output_dir={out}"])
    assert code == 0
    grpo = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl" and "loss" in r]
    assert len(grpo) == 2 and all(r["agent/retokenization_mismatch"] == 0.0 for r in grpo)
    # Replies of at most 2 tokens are short: the rubric's short reward (weight 0.5) at least.
    assert all(0.5 <= r["reward"] <= 1.5 for r in grpo), grpo


def test_a_missing_environment_and_a_mismatched_data_source_are_one_line_each():
    from polyfsdp.trainer.config.job import load_config

    with pytest.raises(ConfigError) as info:
        load_config(["rollout.agent=verifiers:owner/no-such-env@1.0", "data=verifiers"])
    assert str(info.value) == ("rollout.agent=verifiers:owner/no-such-env@1.0: no verifiers environment "
                               "'owner/no-such-env@1.0' is installed (no module 'no_such_env'); install its package "
                               "first (pip install no-such-env, or prime env install owner/no-such-env@1.0); "
                               "polyfsdp never downloads one")
    with pytest.raises(ConfigError, match=r"^data.source=builtin with rollout.agent=verifiers:vf-tiny-sums: .*"
                                          r"set both rollout.agent=verifiers:ENV_ID and data=verifiers$"):
        load_config([f"rollout.agent={SPEC}"])
    with pytest.raises(ConfigError, match=r"^rollout.agent=verifiers:vf-tiny-sums with rollout.env_kwargs=.*: "
                                          r"verifiers refused the environment's config: taskset.count: Input "
                                          r"should be a valid integer.*, got 'many'$"):
        load_config([f"rollout.agent={SPEC}", "data=verifiers", "+rollout.env_kwargs.taskset.count=many"])
    assert sys.modules.get("no_such_env") is None
