"""``polyfsdp-train`` with ``engine.ulysses_sp_size`` under torchrun (gloo, CPU).

Each step's global prompts are split over data-parallel replicas (world size / sp), the ranks
of one SP group share their replica's prompts and sampling seed (so they draw the same
completions), and training goes through the SP engine. So 2 ranks with sp=2 (one replica)
must end one SFT and one RL step with the parameters of 1 rank with sp=1 on the same
prompts (1e-5),
for GRPO, PPO (actor and critic, GAE whitened over replicas), PPO with LoRA (the critic's
value head training beside its adapters) and a multi-turn environment (multi-turn SFT on
demonstrations with tool turns, GRPO over conversations with environment turns); and dp=2 x
sp=2 on 4 processes those of dp=2 x sp=1 on 2 (extended). Since sampling is seeded per global
sample (trainer/rollout/row_seeds.py), 2 replicas of sp=1 draw the same completions too and end GRPO's
step with the same parameters; seeded per replica (what polyfsdp did before), they drew other
completions for half the prompts and differed by far more than the tolerance
(tests/distributed/test_row_seeds_ranks.py keeps that negative control at the level of token ids).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from torchrun_launcher import free_port

from tests.helpers import HELPERS
from polyfsdp.trainer.tracking.metrics import read_metrics

TOL = 1e-5
# A reward with signal (advantages not all zero), a function of the completion alone.
LENGTH_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) % 4) / 3.0
"""
# One SFT step first: its batch goes through the same replica split and the SP engine.
# The actor's AdamW eps is 1e-6, not 1e-8: Adam divides each gradient element by its own RMS, so
# an element whose gradient nearly cancels turns the float noise of a different summation order
# (SP sums over ranks) into a step of up to lr (measured: 1.5e-5 at eps 1e-8 on the PPO case,
# 2.8e-6 at 1e-6, the weights moving 4e-3 in both); with 1e-6 such elements step in proportion to
# their gradient, so the comparison measures how well the gradients agree. The SFT step's optimizer
# too (algo.sft.optim): at its default 1e-8 one element of the agent case's first MLP stepped
# 1.25e-5 apart on an AVX-512 Xeon (5.6e-7 at 1e-6).
OVERRIDES = ["algo.actor.optim.eps=1e-6", "algo.sft.optim.eps=1e-6", "trainer.sft_steps=1", "trainer.sft_batch_size=8", "trainer.rl_steps=1", "trainer.prompts_per_step=4",
             "algo.actor.group_size=4", "data.eval_size=4", "trainer.progress=off", "trainer.plot=false", "trainer.checkpoint_interval=0"]
GUESS_ENV = os.path.join(HELPERS, "envs", "guess_env.py") + ":GuessEnv"
# Multi-turn: SFT on the calculator task's demonstrations (a tool call, the tool's result masked
# out of the loss, the answer), then GRPO over conversations with a user environment from a test
# file that answers "higher"/"lower" for up to 3 turns. The untrained policy seldom guesses right
# and ends some turns with <eos> within the task's 80 tokens, so some RL sequences hold
# environment turns (checked); the length reward is added so the rewards carry a signal.
ENV = ["task=calculator", f"rollout.env={GUESS_ENV}", "rollout.max_turns=3",
       "rollout.env_add_reward_fn=true"]
AGENT = [f"rollout.agent={os.path.join(HELPERS, 'envs', 'agents.py')}:guess",
         "task=calculator", "rollout.env=null", "rollout.max_turns=3", "rollout.env_add_reward_fn=true",
         "rollout.agent_concurrency=4"]
ALGOS = {"grpo": [], "ppo": ["algo=ppo"], "ppo_lora": ["algo=ppo", "model.lora.rank=4"], "env": ENV}


def _launch(out, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "polyfsdp.trainer.train"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "polyfsdp.trainer.train"]
    reward = out.parent / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    result = subprocess.run([*command, *OVERRIDES, f"reward.fn={reward}:score", *extra, f"trainer.output_dir={out}"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result


def _weights(out) -> dict:
    state = load_file(str(out / "final" / "model.safetensors"))
    head = out / "final" / "value_head.safetensors"
    if head.is_file():
        state.update({f"value_head.{k}": v for k, v in load_file(str(head)).items()})
    return state


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _records(out, phase: str):
    return [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == phase]


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_two_ranks_with_sp2_equal_one_rank(tmp_path, algo):
    one, two = tmp_path / "one", tmp_path / "sp2"
    _launch(one, 1, *ALGOS[algo])
    shown = _launch(two, 2, *ALGOS[algo], "engine.ulysses_sp_size=2")
    assert "1 replica(s) x sequence-parallel 2" in shown.stdout
    start = load_file(str(one / "init_model" / "model.safetensors"))
    final_one = load_file(str(one / "final" / "model.safetensors"))
    moved = _max_diff({k: final_one[k] for k in start}, start)
    assert moved > 100 * TOL, f"the steps must move the weights well beyond the tolerance (moved {moved:.3g})"
    assert _max_diff(_weights(two), _weights(one)) <= TOL
    (sft1,), (sft2,) = _records(one, "sft"), _records(two, "sft")
    assert sft2["loss"] == pytest.approx(sft1["loss"], rel=1e-5)
    r1, r2 = _records(one, "rl"), _records(two, "rl")
    assert r1[0]["reward_std"] > 0, "the reward must carry a signal"
    if algo == "env":
        assert r1[0]["multi_turn/turns_mean"] > 1.25, "the conversations must hold environment turns"
    for key in ("reward", "response_len", "loss", "grad_norm") + (("multi_turn/turns_mean",) if algo == "env" else ()):
        assert r2[0][key] == pytest.approx(r1[0][key], rel=1e-5, abs=1e-7), key
    if algo == "grpo":
        # Two sp=1 replicas, each sampling half of the prompts: the same completions, rows seeded globally.
        dp2 = tmp_path / "dp2"
        _launch(dp2, 2)
        assert _max_diff(_weights(dp2), _weights(one)) <= TOL


def test_agents_on_two_replicas_train_as_on_one_rank(tmp_path):
    """rollout.agent (GuessEnv's game played by an openai-client agent) on two replicas: each rank
    serves its own endpoint to its share of the conversations, one example's group per round
    (agent_concurrency=4, group size 4), the ranks taking as many rounds as the busiest; the rows
    are seeded globally, so the weights equal one rank's."""
    pytest.importorskip("openai")
    one, two = tmp_path / "one", tmp_path / "dp2"
    _launch(one, 1, *AGENT)
    _launch(two, 2, *AGENT)
    r1, r2 = _records(one, "rl"), _records(two, "rl")
    assert r1[0]["reward_std"] > 0 and r1[0]["multi_turn/turns_mean"] > 1.25
    assert r1[0]["agent/retokenization_mismatch"] == 0.0
    for key in ("reward", "response_len", "loss", "multi_turn/turns_mean"):
        assert r2[0][key] == pytest.approx(r1[0][key], rel=1e-5, abs=1e-7), key
    assert _max_diff(_weights(two), _weights(one)) <= TOL


@pytest.mark.extended
def test_dp2_sp2_on_four_processes_equals_dp2_sp1_on_two(tmp_path):
    _launch(tmp_path / "dp2", 2, "algo=ppo")
    _launch(tmp_path / "dp2sp2", 4, "algo=ppo", "engine.ulysses_sp_size=2")
    assert _max_diff(_weights(tmp_path / "dp2sp2"), _weights(tmp_path / "dp2")) <= TOL
