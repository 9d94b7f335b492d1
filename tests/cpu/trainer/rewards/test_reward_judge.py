"""reward.judge (trainer/rewards/judge.py) against a stub OpenAI-compatible server made here: the
rendered prompt reaches the server, verdicts parse as numbers, labels or a pattern's group, an
unparsable verdict follows on_unparsable, a 5xx is retried, and every failure is one line naming
the judge and the record. (A judge served by vLLM: tests/cpu/trainer/rollout/servers/test_server_rollout.py.)"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.errors import ConfigError, RewardError
from polyfsdp.trainer.rewards.judge import Judge, JudgeSettings, parse_verdict


class StubJudge:
    """An OpenAI-compatible server whose verdict is ``verdicts[response]`` (the text after
    "Response: " in the prompt); ``fail_first`` answers that many requests with a 500 first,
    ``delay_s`` sleeps before answering."""

    def __init__(self, verdicts, fail_first=0, delay_s=0.0):
        self.verdicts, self.fail_first, self.delay_s, self.requests = verdicts, fail_first, delay_s, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the judge gave up waiting (the timeout case)

            def do_GET(self):
                self._send(200, {"data": [{"id": "stub-judge"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, body))
                if stub.fail_first > 0:
                    stub.fail_first -= 1
                    return self._send(500, {"error": {"message": "overloaded"}})
                threading.Event().wait(stub.delay_s)
                prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
                response = prompt.split("Response: ")[1]
                verdict = stub.verdicts(response) if callable(stub.verdicts) else stub.verdicts[response]
                choice = {"message": {"role": "assistant", "content": verdict}} if "messages" in body else \
                    {"text": verdict}
                self._send(200, {"choices": [{"index": 0, **choice, "finish_reason": "stop"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    servers = []

    def start(verdicts, **kwargs):
        servers.append(StubJudge(verdicts, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


TEMPLATE = "Q: {prompt} A: {ground_truth} Response: {response}"
EXAMPLES = [Example("2+2", "4", where="r0"), Example("3+3", "6", where="r1")]


def _judge(url, **settings):
    return Judge(JudgeSettings.from_section({"url": url, "template": TEMPLATE, "retries": 0, **settings}), url)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_the_judge_sends_the_rendered_prompt_greedily_and_parses_each_verdict(stub, api):
    server = stub({"4": "Score: 9/10", "5": "I give it 2.5", "6": "10", "7": "no idea"})
    judge = _judge(server.url, api=api)
    rewards, extras = judge.score_all(EXAMPLES, ["4", "5", "6", "7"], [[]] * 4, group=2)
    assert rewards == [9.0, 2.5, 10.0, 0.0] and extras == {"judge_unparsable": [0.0, 0.0, 0.0, 1.0]}
    routes = {path for path, _ in server.requests}
    assert routes == {"/v1/chat/completions" if api == "chat" else "/v1/completions"}
    bodies = sorted((b.get("prompt") or b["messages"][0]["content"]) for _, b in server.requests)
    assert bodies[0] == "Q: 2+2 A: 4 Response: 4" and bodies[-1] == "Q: 3+3 A: 6 Response: 7"
    assert all(b["temperature"] == 0.0 and b["model"] == "stub-judge" and b["max_tokens"] == 64
               for _, b in server.requests)


def test_labels_and_patterns_parse_the_verdict():
    labels = JudgeSettings(url="x", parse="labels", labels={"correct": 1, "incorrect": 0, "partly correct": 0.5})
    assert parse_verdict("It is INCORRECT.", labels) == 0.0
    assert parse_verdict("correct, though incorrect in places", labels) == 1.0
    assert parse_verdict("partly correct", labels) == 0.5 and parse_verdict("maybe", labels) is None
    pattern = JudgeSettings(url="x", parse="regex", pattern=r"\[\[(\w+)\]\]")
    assert parse_verdict("so [[7]] it is", pattern) == 7.0 and parse_verdict("[[seven]]", pattern) is None
    graded = JudgeSettings(url="x", parse="regex", pattern=r"Verdict: (\w+)", labels={"yes": 1, "no": -1})
    assert parse_verdict("Verdict: no", graded) == -1.0 and parse_verdict("Verdict: maybe", graded) is None


def test_an_unparsable_verdict_is_zero_skipped_to_its_groups_mean_or_one_line(stub):
    server = stub({"a": "8", "b": "??", "c": "??", "d": "??"})
    assert _judge(server.url, on_unparsable="skip").score_all(EXAMPLES, ["a", "b", "c", "d"], [[]] * 4,
                                                              group=2)[0] == [8.0, 8.0, 0.0, 0.0]
    with pytest.raises(RewardError) as info:
        _judge(server.url, on_unparsable="error").score_all(EXAMPLES, ["a", "b"], [[]] * 2, group=2)
    assert str(info.value) == ("reward.judge: the verdict '??' does not parse as parse=number (record r0); fix "
                               "reward.judge.template/pattern or set reward.judge.on_unparsable=zero|skip")


def test_skip_fills_from_the_group_inside_the_weighted_sum(stub):
    """The sources' sum hands each source its rows grouped, so skip sees the group."""
    from polyfsdp.trainer.rewards.sources import WeightedReward

    server = stub({"a": "8", "b": "??", "c": "4", "d": "2"})
    rows = [Example("2+2", "4", where="r0", data_source="x"), Example("3+3", "6", where="r1", data_source="x")]
    total, extras = WeightedReward([_judge(server.url, on_unparsable="skip", weight=0.5)]).score_all(
        rows, ["a", "b", "c", "d"], [[]] * 4, group=2)
    assert total == [4.0, 4.0, 2.0, 1.0] and extras["judge"] == [8.0, 8.0, 4.0, 2.0]


def test_a_5xx_is_retried_and_every_failure_is_one_line_naming_the_judge_and_the_record(stub):
    server = stub({"4": "7"}, fail_first=2)
    assert _judge(server.url, retries=2).score_all(EXAMPLES[:1], ["4"], [[]])[0] == [7.0]
    server.fail_first = 3
    with pytest.raises(RewardError) as info:
        _judge(server.url, retries=1).score_all(EXAMPLES[:1], ["4"], [[]])
    assert str(info.value) == (f"reward.judge ({server.url}) POST /chat/completions: HTTP 500: overloaded after 2 "
                               f"tries (record r0)")
    slow = stub({"4": "7"}, delay_s=2.0)
    with pytest.raises(RewardError, match=r"no answer within reward.judge.timeout_s=0.3 s \(record r0\)$"):
        _judge(slow.url, timeout_s=0.3).score_all(EXAMPLES[:1], ["4"], [[]])
    closed = server.url
    server.close()
    with pytest.raises(RewardError, match=r"GET /models: not reachable .*\(listing the served models\)$"):
        _judge(closed).score_all(EXAMPLES[:1], ["4"], [[]])
    from polyfsdp.trainer.rewards.judge import build_judge

    with pytest.raises(RewardError, match=r"GET /models: not reachable .* after 2 tries \(checking the judge at start\)$"):
        build_judge({"url": closed, "retries": 1})


@pytest.mark.parametrize("section,message", [
    ({}, "reward.judge: set one of url"),
    ({"url": "u", "checkpoint": "c"}, "reward.judge: set one of url"),
    ({"url": "u", "parse": "vibes"}, "reward.judge.parse='vibes': expected one of number, labels, regex"),
    ({"url": "u", "parse": "labels"}, "reward.judge.parse=labels needs reward.judge.labels"),
    ({"url": "u", "parse": "regex", "pattern": "(x"}, "reward.judge.pattern='(x': not a regular expression"),
    ({"url": "u", "template": "{prompt} {answer}"}, "reward.judge.template: unknown field {answer}"),
    ({"url": "u", "template": "{prompt}"}, "reward.judge.template: it never shows the judge the {response}"),
    ({"url": "u", "on_unparsable": "drop"}, "reward.judge.on_unparsable='drop': expected one of zero, error, skip"),
    ({"url": "u", "parse": "labels", "labels": {"yes": 1}},
     "reward.judge.parse=labels: the default template asks for a score from 0 to 10; set reward.judge.template"),
    ({"url": "u", "concurrency": 0}, "reward.judge.concurrency: expected an int >= 1, got 0"),
    ({"url": "u", "temperature": 1}, "reward.judge.temperature: not a judge setting"),
])
def test_bad_judge_settings_are_one_line(section, message):
    with pytest.raises(ConfigError) as info:
        JudgeSettings.from_section(section)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_a_grpo_job_with_a_function_and_a_judge_logs_each_and_trains(stub, tmp_path):
    """reward.fn (weight 0.5) beside reward.judge (weight 2, a stub whose verdict is the response's
    length mod 4): every rollout row's reward is the weighted sum, each source is logged."""
    from polyfsdp.trainer.rewards.rules import char_match
    from polyfsdp.trainer.train import main

    server = stub(lambda response: f"Score: {len(response) % 4}")
    out = tmp_path / "run"
    judge = f"reward.judge={{url:'{server.url}',template:'Q: {{prompt}} Response: {{response}}',weight:2}}"
    assert main(["trainer.sft_steps=0", "trainer.rl_steps=2", "trainer.prompts_per_step=2", "algo.actor.group_size=2",
                 "trainer.progress=off", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0",
                 "data.eval_size=2", "trainer.log_rollout_samples=2", "reward.fn=char_match", "reward.weight=0.5",
                 judge, f"trainer.output_dir={out}"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["phase"] == "rl"]
    assert len(steps) == 2 and all(s["grad_norm"] > 0 for s in steps)
    for r in steps + [r for r in records if r["phase"] == "eval"]:
        assert abs(r["reward"] - (0.5 * r["reward/fn"] + 2 * r["reward/judge"])) <= 1e-6
        assert r["reward/judge_unparsable"] == 0.0
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()
            if json.loads(line)["tag"] == "rollout"]
    assert rows
    for row in rows:
        expected = 0.5 * char_match("", row["completion"], row["ground_truth"]) + 2 * (len(row["completion"]) % 4)
        assert abs(row["reward"] - expected) <= 1e-6, row


def test_judge_settings_are_checked_when_the_config_loads(tmp_path):
    from polyfsdp.trainer.config.job import load_config

    assert load_config(["reward.fn=none", "reward.judge={url:'http://h:1/v1'}"]).reward.judge == {"url": "http://h:1/v1"}
    with pytest.raises(ConfigError, match=r"^reward.judge.parse='vibes': expected one of"):
        load_config(["reward.judge={url:u,parse:vibes}"])
    with pytest.raises(ConfigError, match=r"^reward.judge.checkpoint=/nope: no such directory$"):
        load_config(["reward.judge={checkpoint:/nope}"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no tokenizer files"):
        load_config([f"reward.judge={{checkpoint:'{tmp_path}'}}"])
    with pytest.raises(ConfigError, match="reward.judge.data_sources: expected null"):
        load_config(["reward.judge={url:u,data_sources:[]}"])


@pytest.mark.parametrize("mode", ["flood", "flood-length"])
def test_an_answer_larger_than_max_tokens_can_take_is_refused_in_one_line_without_reading_it(mode):
    """A judge answering 50 MB (streamed, or announced by its Content-Length): the judge reads at
    most its cap (64 KiB + 256 bytes a token) and closes; the server could send little of the 50 MB."""
    from tests.helpers.misbehaving_http import MODEL, MisbehavingJudge

    from polyfsdp.trainer.rewards.judge import answer_cap

    server = MisbehavingJudge(mode, flood_bytes=50 << 20)
    try:
        judge = _judge(server.url, model=MODEL, max_tokens=16)
        with pytest.raises(RewardError) as info:
            judge.score_all(EXAMPLES[:1], ["4"], [[]])
        judge.close()
    finally:
        server.close()
    assert answer_cap(16) == 65536 + 256 * 16
    assert str(info.value) == (
        f"reward.judge ({server.url}) POST /chat/completions: the answer is over 69632 bytes, the most read for "
        f"reward.judge.max_tokens=16 (65536 + 256 a token); is reward.judge.url an OpenAI-compatible server? (raise "
        f"reward.judge.max_tokens for longer verdicts) (record r0)")
    # What the sockets' buffers held once the judge stopped reading (a few MB on loopback), not the 50 MB.
    assert server.sent < 20 << 20, server.sent


@pytest.mark.parametrize("mode", ["drip-headers", "drip-body"])
def test_a_judge_dripping_its_answer_is_stopped_at_timeout_s_overall(mode):
    """One byte every 0.5 s, 60 bytes: each read is quick, so only an overall deadline stops the
    request at timeout_s=2 (without one, the drip ends after 30 s and the answer is not JSON)."""
    from tests.helpers.misbehaving_http import MODEL, MisbehavingJudge

    server = MisbehavingJudge(mode, interval_s=0.5, count=60)
    try:
        judge = _judge(server.url, model=MODEL, timeout_s=2)
        with pytest.raises(RewardError) as info:
            judge.score_all(EXAMPLES[:1], ["4"], [[]])
        judge.close()
    finally:
        server.close()
    assert str(info.value) == (f"reward.judge ({server.url}) POST /chat/completions: no answer within "
                               f"reward.judge.timeout_s=2 s (record r0)")


def test_a_judge_checkpoint_on_several_nodes_is_refused_in_one_line_pointing_to_url(tmp_path, monkeypatch):
    """Its server listens on 127.0.0.1 of rank 0's node: a run over 2 nodes (torchrun's
    WORLD_SIZE=4, LOCAL_WORLD_SIZE=2) is told at start, before any server starts; one node is not."""
    from polyfsdp.backends.topology import node_count
    from polyfsdp.trainer.rewards import judge_server
    from polyfsdp.trainer.rewards.judge import build_judge

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    started = []

    class NoServer:  # what build_judge starts on rank 0 (vLLM is not needed to decide)
        def __init__(self, *args):
            started.append(args)

        def start(self):
            return "http://127.0.0.1:1/v1"

        def stop(self):
            pass

    monkeypatch.setattr(judge_server, "JudgeServer", NoServer)
    for world, per_node, nodes in ((4, 2, 2), (4, 4, 1), (4, None, 1), (1, None, 1), (6, 2, 3)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        if per_node is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
        assert node_count() == nodes, (world, per_node)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as info:
        build_judge({"checkpoint": str(tmp_path)})
    assert str(info.value) == (
        "reward.judge.checkpoint: the judge's vLLM server runs on rank 0's node only (on 127.0.0.1), which the ranks "
        "of the other 1 of this run's 2 nodes cannot reach; serve the judge where every node reaches it (python -m "
        "vllm.entrypoints.openai.api_server --model DIR --host 0.0.0.0 --port PORT) and give "
        "reward.judge.url=http://HOST:PORT/v1 instead of reward.judge.checkpoint")
    assert started == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process here (no process group): rank 0 of one node
    judge = build_judge({"checkpoint": str(tmp_path)})
    assert judge.url == "http://127.0.0.1:1/v1" and len(started) == 1
    judge.close()
