"""A completion vLLM reports with finish_reason 'abort' (it cancelled the request) is no sample:
the colocated engine's adapter (trainer/rollout/vllm_adapter.py) and the rollout servers' requests
(trainer/rollout/servers/completions.py) ask for it again with the same seed, a bounded number of
times (ABORT_REDRAWS), then stop in one line naming the engine or server. Without vLLM: fake
output objects shaped as vLLM's RequestOutput, and a fake server."""
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.rollout import vllm_adapter
from polyfsdp.trainer.rollout.engines import ABORT_REDRAWS, SamplingParams
from polyfsdp.trainer.rollout.servers.completions import sample_rows
from polyfsdp.trainer.rollout.servers.http import ServerError


@dataclass
class FakeSamplingParams:
    seed: int
    options: dict = field(default_factory=dict)

    def __init__(self, seed, **options):
        self.seed, self.options = seed, options


class FakeLLM:
    """``llm.generate`` as vLLM's: one output per request, ``outputs[0]`` with token_ids and
    finish_reason; the completion is a function of (prompt, seed); ``aborts[seed]``: how many
    times that request is aborted first (empty, as vLLM's aborted outputs come back)."""

    def __init__(self, aborts):
        self.aborts, self.calls = dict(aborts), []

    def generate(self, prompts, requests, use_tqdm=False):
        self.calls.append([r.seed for r in requests])
        outs = []
        for prompt, request in zip(prompts, requests):
            if self.aborts.get(request.seed, 0) > 0:
                self.aborts[request.seed] -= 1
                done = types.SimpleNamespace(token_ids=[], logprobs=[], finish_reason="abort")
            else:
                done = types.SimpleNamespace(token_ids=[request.seed % 50, 2], logprobs=None, finish_reason="stop")
            outs.append(types.SimpleNamespace(outputs=[done], prompt_token_ids=prompt["prompt_token_ids"]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=FakeSamplingParams))


PARAMS = SamplingParams(4, stop_token_ids=(2,))


def test_an_aborted_colocated_completion_is_drawn_again_with_its_seed(fake_vllm):
    llm = FakeLLM({12: 2})  # row 1 aborted twice, then sampled
    completions, _ = vllm_adapter.sample(llm, [[1, 3], [1, 4], [1, 5]], PARAMS, [11, 12, 13])
    assert completions == [[11, 2], [12, 2], [13, 2]]  # what the uninterrupted draw gives
    assert llm.calls == [[11, 12, 13], [12], [12]]


def test_a_completion_aborted_on_every_try_stops_in_one_line(fake_vllm):
    llm = FakeLLM({12: 99, 13: 99})
    with pytest.raises(ConfigError) as failure:
        vllm_adapter.sample(llm, [[1, 3], [1, 4], [1, 5]], PARAMS, [11, 12, 13])
    said = str(failure.value)
    assert "\n" not in said and said.startswith("rollout.engine=vllm: aborted the completion of row 1 of 3 "
                                                f"(2 row(s) in all) {ABORT_REDRAWS + 1} times with the same seed")
    assert "finish_reason 'abort'" in said
    assert len(llm.calls) == ABORT_REDRAWS + 1


class FakeServer:
    """A rollout server's /v1/completions: ``aborts`` first answers of each seed are aborted."""

    name, url = "rollout server 0", "http://127.0.0.1:1"

    def __init__(self, aborts):
        self.aborts, self.seeds = dict(aborts), []

    def request(self, route, body, cap=None):
        seed = body["seed"]
        self.seeds.append(seed)
        if self.aborts.get(seed, 0) > 0:
            self.aborts[seed] -= 1
            return {"choices": [{"token_ids": [], "logprobs": None, "finish_reason": "abort"}]}
        return {"choices": [{"token_ids": [seed % 50, 2], "logprobs": None, "finish_reason": "stop"}]}


def test_an_aborted_server_completion_is_requested_again_with_its_seed():
    server = FakeServer({21: 1})
    with ThreadPoolExecutor(2) as pool:
        tokens, _ = sample_rows([server], "policy", [[1, 3], [1, 4]], PARAMS, [20, 21], pool)
    assert tokens == [[20, 2], [21, 2]]
    assert sorted(server.seeds) == [20, 21, 21]


def test_a_server_that_aborts_a_completion_every_time_is_named_in_one_line():
    server = FakeServer({21: 99})
    with ThreadPoolExecutor(2) as pool, pytest.raises(ServerError) as failure:
        sample_rows([server], "policy", [[1, 3], [1, 4]], PARAMS, [20, 21], pool)
    said = str(failure.value)
    assert "\n" not in said and said.startswith("rollout server 0 (http://127.0.0.1:1): aborted the completion of "
                                                f"row 1 of 2 {ABORT_REDRAWS + 1} times with the same seed")
    assert server.seeds.count(21) == ABORT_REDRAWS + 1
