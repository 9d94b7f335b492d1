"""Asynchronous RL (trainer/algos/sample_ahead.py), in process on one rank: with
``rollout.max_staleness`` k, the batch step t trains on was drawn by the policy after
max(0, t - k) updates, counted on the policy itself (its optimizer steps when the batch was
sampled), not from the pipeline's own bookkeeping; the sampler's log-probs the loss corrects
with are that policy's (an HF forward of the model at sampling time); the correction sees the
difference (zero mismatch on the fresh batch, not after); a server that stalls during a
background round stops the step within its request timeout with one line naming it, and leaves
the queue as it was; the queue survives its plain form."""
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.trainer.algos.rl_step import RLContext
from polyfsdp.trainer.algos.rl_steps import RLSteps
from polyfsdp.trainer.algos.sample_ahead import SampleAhead
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.data.task import ReverseTask
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver
from polyfsdp.trainer.rollout.engines import Completions, PolicyDecoding
from polyfsdp.trainer.rollout.servers.completions import sample_rows
from polyfsdp.trainer.rollout.servers.http import ServerError, ServerHttp
from tests.helpers.vllm_cases import write_checkpoint

TOK = CharTokenizer()
PROMPTS, GROUP = 4, 4


def _steps(tmp_path, k_overrides=()):
    cfg = load_config(["algo.actor.kl_coef=0", f"algo.actor.group_size={GROUP}", "algo.actor.max_new_tokens=6",
                       "algo.rollout_correction.report_mismatch=true", "algo.rollout_correction.tis_cap=2.0",
                       "algo.actor.optim.lr=0.05", *k_overrides])
    path = write_checkpoint(tmp_path / "policy", "qwen2-tiny", TOK, seed=5)
    policy = FSDPEngine(ModelConfig(path=path), EngineConfig(), OptimConfig(lr=0.05)).initialize()
    task = ReverseTask()
    examples = lambda step: [task.sample(random.Random(100 * step + i)) for i in range(PROMPTS)]  # noqa: E731
    driver = SingleTurnDriver(PolicyDecoding("builtin"))
    ctx = RLContext(policy, TOK, cfg.algo, cfg.algo.actor_loss(PROMPTS), driver=driver)
    steps = RLSteps(ctx, seed=0, replica=0, examples=examples, refill=lambda step, k: examples(1000 * k + step),
                    first_prompt=0)
    return policy, steps


def _hf_log_probs(policy, prompt, response):
    """log p(response | prompt) per response token from the model's own forward (temperature 1)."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = policy.module(input_ids=ids).logits.float()
    log_probs = torch.log_softmax(logits[0, len(prompt) - 1:-1], dim=-1)
    return log_probs.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("k", [1, 2])
def test_each_trained_batch_was_drawn_k_updates_back_and_the_loss_sees_the_difference(tmp_path, monkeypatch, k):
    policy, steps = _steps(tmp_path)
    sampled_at, trained = {}, []
    sample, train = steps.sample, steps.train

    def sample_and_check(step, **kwargs):
        batch = sample(step, **kwargs)
        sampled_at[step] = policy.global_step  # the policy's own count of updates when it drew the batch
        roll = batch.rollout
        for prompt, response, log_probs in zip(roll.prompt_ids, roll.response_ids, roll.log_probs):
            expected = _hf_log_probs(policy, prompt, response)
            assert torch.allclose(torch.tensor(log_probs), expected, atol=1e-5), (step, log_probs, expected)
        return batch

    def train_and_note(step, batch, timing):
        trained.append((step, batch.version, policy.global_step))
        return train(step, batch, timing)

    monkeypatch.setattr(steps, "sample", sample_and_check)
    monkeypatch.setattr(steps, "train", train_and_note)
    total = 5
    pipeline = SampleAhead(steps, k, total)
    records = [pipeline.step(t) for t in range(total)]
    assert [t for t, _, _ in trained] == list(range(total))
    for t, version, updates_now in trained:
        assert updates_now == t
        assert sampled_at[t] == version == max(0, t - k), (t, sampled_at, trained)
    assert [r["async/staleness"] for r in records] == [float(min(t, k)) for t in range(total)]
    # The fresh batch's sampler is the trainer: no mismatch, TIS weights 1; a stale one differs.
    assert records[0]["rollout_mismatch_abs_max"] < 1e-5 and records[0]["tis_weight_mean"] == pytest.approx(1, abs=1e-5)
    for record in records[k:]:
        assert record["rollout_mismatch_abs_mean"] > 1e-4, record
    assert pipeline.queue == {}


def test_the_queue_round_trips_through_its_plain_form(tmp_path):
    policy, steps = _steps(tmp_path)
    pipeline = SampleAhead(steps, 2, 6)
    pipeline.step(0)
    state = pipeline.state()
    assert [entry["step"] for entry in state] == [1, 2]
    again = SampleAhead(steps, 2, 6)
    again.load(state, at_step=1)
    assert again.state() == state
    with pytest.raises(Exception, match="before its own step"):
        again.load(state, at_step=2)
    # Resumed with k=1: step 2's batch is ahead of the horizon (and step 1's, drawn by version 0, is
    # within 1); nothing is trained staler than the resumed run's k.
    smaller = SampleAhead(steps, 1, 6)
    assert smaller.load(state, at_step=1) == 1 and sorted(smaller.queue) == [1]
    assert SampleAhead(steps, 0, 6).load(state, at_step=1) == 2


def test_a_server_that_stalls_ends_the_step_in_one_line_within_its_timeout_and_leaves_the_queue(tmp_path, monkeypatch):
    policy, steps = _steps(tmp_path)
    pipeline = SampleAhead(steps, 1, 4)
    pipeline.step(0)
    before = pipeline.state()
    engine = steps.ctx.driver.engine
    monkeypatch.setattr(type(engine), "samples_beside_training", True)
    stalled = socket.socket()  # accepts connections (the backlog) and never answers
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(64)
    server = ServerHttp(f"http://127.0.0.1:{stalled.getsockname()[1]}", "rollout server 0", timeout_s=1.0)
    with ThreadPoolExecutor(8) as pool:
        monkeypatch.setattr(engine, "generate", lambda prompts, params, seeds=None: Completions(
            *sample_rows([server], "policy", prompts, params, seeds, pool)))
        started = time.monotonic()
        with pytest.raises(ServerError) as failure:
            pipeline.step(1)
    stalled.close()
    assert time.monotonic() - started < 60
    assert "\n" not in str(failure.value) and "rollout server 0" in str(failure.value) and \
        "no answer within 1 s (rollout.server.request_timeout_s)" in str(failure.value)
    assert pipeline.state() == before and pipeline.background is None
