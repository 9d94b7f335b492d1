"""Demonstration conversations in data files (trainer/data/demonstrations.py): a record's ``messages``
in chat format, assistant tool calls included, is the conversation the multi-turn SFT trains on
(only assistant tokens in the loss); malformed records stop with one line naming the file, the
record and the field."""
import json

import pytest
from tests.helpers import ROOT
from tests.cpu.trainer.rollout.test_multi_turn import ScriptedEngine
from tests.cpu.trainer.algos.test_tool_sft import TOKENIZERS

from polyfsdp.trainer.errors import DataError
from polyfsdp.trainer.data.sources import read_files
from polyfsdp.trainer.rollout.drivers.multi_turn import MultiTurnDriver, MultiTurnSettings
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.algos.tool_sft import conversation_sequences
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.tool_task import CalculatorTask

PRODUCTS = [(17, 23), (45, 67), (99, 12), (31, 88)]


def _calls(a, b, arguments_as_text):
    arguments = {"expression": f"{a}*{b}"}
    return [{"type": "function", "function": {"name": "calculator",
                                              "arguments": json.dumps(arguments) if arguments_as_text else arguments}}]


def _record(a, b, arguments_as_text=False):
    """A product's demonstration in OpenAI's chat format: a turn that only calls the tool
    (content null), the tool's result, the answer; no prompt or answer field."""
    return {"messages": [{"role": "user", "content": f"{a}*{b}"},
                         {"role": "assistant", "content": None, "tool_calls": _calls(a, b, arguments_as_text)},
                         {"role": "tool", "content": str(a * b)},
                         {"role": "assistant", "content": str(a * b)}]}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _read(path):
    return read_files(path, "data.train_files", "prompt", None)


def _calculator():
    return MultiTurnDriver(ScriptedEngine(None, []), MultiTurnSettings("calculator", {}, 2, None, False),
                           max_positions=None)


def test_a_record_carries_its_conversation_and_takes_prompt_and_answer_from_it(tmp_path):
    records = [_record(a, b, arguments_as_text=i % 2 == 1) for i, (a, b) in enumerate(PRODUCTS)]
    examples = _read(_write(tmp_path / "demos.jsonl", records))
    for (a, b), ex in zip(PRODUCTS, examples):
        # The text the policy writes when it calls the tool (what parse_tool_calls reads), by hand.
        call = '<tool_call>{"name":"calculator","arguments":{"expression":"%d*%d"}}</tool_call>' % (a, b)
        assert ex.conversation == ({"role": "user", "content": f"{a}*{b}"}, {"role": "assistant", "content": call},
                                   {"role": "tool", "content": str(a * b)},
                                   {"role": "assistant", "content": str(a * b)})
        assert ex.messages == ({"role": "user", "content": f"{a}*{b}"},) and ex.prompt == f"{a}*{b}"
        assert ex.answer == str(a * b)


def test_explicit_prompt_and_answer_fields_win_over_the_conversations():
    from polyfsdp.trainer.data.sources import _record as record

    ex = record({**_record(17, 23), "prompt": "what is 17*23?", "answer": "391"}, "f line 1", "prompt", None)
    assert ex.prompt == "what is 17*23?" and ex.messages is None and ex.answer == "391"
    assert len(ex.conversation) == 4


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_file_demonstrations_train_the_sequences_the_builtin_task_trains(tmp_path, name):
    # Independent reference: the built-in calculator task's demonstration of the same product,
    # whose SFT sequence tests/cpu/trainer/algos/test_tool_sft.py checks against a rollout of the same turns.
    tok = TOKENIZERS[name]()
    examples = _read(_write(tmp_path / "demos.jsonl", [_record(a, b) for a, b in PRODUCTS]))
    builtin = [CalculatorTask().sample(_Fixed(a, b)) for a, b in PRODUCTS]
    got = conversation_sequences(_calculator(), tok, examples)
    assert got == conversation_sequences(_calculator(), tok, builtin)
    for (prompt, response, mask), ex in zip(got, examples):
        trained = [t for t, m in zip(response, mask) if m]
        assistant = [m["content"] for m in ex.conversation if m["role"] == "assistant"]
        # Each turn ends as the sampler ends one: <eos>, or the template's end-of-turn token apart from it.
        turn_end = SamplingParams.for_tokenizer(tok, 1).stop_token_ids[-1]
        assert trained == [t for text in assistant for t in tok.encode(text) + [turn_end]]
        assert sum(1 for m in mask if not m) > 0  # the tool's result is there, out of the loss


class _Fixed:
    """A random.Random stand-in drawing ``a`` then ``b``."""

    def __init__(self, a, b):
        self.values = [a, b]

    def randint(self, low, high):
        return self.values.pop(0)


@pytest.mark.parametrize("messages, expected", [
    ([], "field 'messages' must be a non-empty list of chat messages"),
    ("hi", "field 'messages' must be a non-empty list of chat messages"),
    ([{"role": "user", "content": "q"}], "field 'messages' has no assistant message"),
    ([{"role": "assistant", "content": "a"}], "field 'messages' starts with an assistant message"),
    ([{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}],
     "field 'messages' message 1 has role 'robot'; expected one of system, user, assistant, tool"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}],
     "field 'messages' message 0 'content' must be text or a list of image and text parts, got int"),
    ([{"role": "user", "content": "q"}, "a"], "field 'messages' message 1 must be an object"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
     "field 'messages' message 1 tool call 0 must be {\"function\": {\"name\": text"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "field 'messages' message 1 tool call 0 'arguments' is text that is not JSON"),
    ([{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f"}}]},
      {"role": "assistant", "content": "a"}], "field 'messages' message 0 has 'tool_calls' but role 'user'"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "7"}, {"role": "assistant", "content": "a"}],
     "field 'messages' message 1 is a tool result before any assistant turn called a tool"),
])
def test_a_malformed_demonstration_is_one_line_naming_the_file_the_record_and_the_field(tmp_path, messages,
                                                                                          expected):
    path = _write(tmp_path / "demos.jsonl", [_record(17, 23), {"messages": messages}])
    with pytest.raises(DataError) as info:
        _read(path)
    message = str(info.value)
    assert message.startswith(f"{path} line 2: ") and expected in message and "\n" not in message


def test_a_parquet_file_carries_demonstrations(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [_record(a, b, arguments_as_text=True) for a, b in PRODUCTS]  # OpenAI's arguments: JSON text
    path = str(tmp_path / "demos.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [ex.conversation for ex in _read(path)] == \
        [ex.conversation for ex in _read(_write(tmp_path / "demos.jsonl", rows))]


def test_file_demonstrations_train_through_polyfsdp_train(tmp_path, monkeypatch):
    """data.train_files with conversation-only records and rollout.env=calculator: every SFT
    sequence is a file conversation with its assistant tokens (and only those) in the loss."""
    import random

    import polyfsdp.trainer.algos.tool_sft as tool_sft
    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    rng = random.Random(3)
    products = {(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(40)}
    path = _write(tmp_path / "demos.jsonl", [_record(a, b) for a, b in sorted(products)])
    seen = []
    real = tool_sft.conversation_sequences

    def recording(rollout, tokenizer, examples):
        out = real(rollout, tokenizer, examples)
        seen.extend((tokenizer, ex, seq) for ex, seq in zip(examples, out))
        return out

    monkeypatch.setattr(tool_sft, "conversation_sequences", recording)
    out = tmp_path / "run"
    code = main(["data=files", f"data.train_files=[{path}]", "data.eval_size=4", "rollout.env=calculator",
                 "rollout.max_turns=2", "algo.actor.max_new_tokens=80", "trainer.sft_steps=2",
                 "trainer.sft_batch_size=4", "trainer.rl_steps=1", "trainer.prompts_per_step=2",
                 "algo.actor.group_size=2", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
                 f"trainer.output_dir={out}"])
    assert code == 0
    assert len(seen) == 2 * 4
    for tokenizer, ex, (prompt, response, mask) in seen:
        assert isinstance(ex, Example) and ex.where.startswith(path)
        trained = tokenizer.decode([t for t, m in zip(response, mask) if m and t != tokenizer.eos_token_id])
        call, answer = (m["content"] for m in ex.conversation if m["role"] == "assistant")
        assert trained == call + answer and "<tool_call>" in call
    phases = [r["phase"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r]
    assert phases.count("sft") == 2 and phases.count("rl") == 1


def test_demonstrations_without_an_environment_are_named_as_unused(tmp_path):
    from polyfsdp.trainer.data.demonstrations import unused_demonstrations_note

    examples = _read(_write(tmp_path / "demos.jsonl", [_record(17, 23)]))
    assert "not trained on without rollout.env" in unused_demonstrations_note(examples, None)
    assert unused_demonstrations_note(examples, "calculator") is None
    assert unused_demonstrations_note([Example("p", "a")], None) is None
    # One exchange (the prompt's messages, then the answer) is what SFT trains without an environment.
    single = _read(_write(tmp_path / "single.jsonl", [{"messages": [{"role": "user", "content": "17*23"},
                                                                   {"role": "assistant", "content": "391"}]}]))
    assert unused_demonstrations_note(single, None) is None


def test_the_docs_demonstration_record_reads_as_written(tmp_path):
    import re

    page = (ROOT / "docs" / "multi-turn.md").read_text()
    (block,) = [b for b in re.findall(r"```json\n(.*?)```", page, re.DOTALL) if '"messages"' in b]
    (ex,) = _read(_write(tmp_path / "demos.jsonl", [json.loads(block)]))
    assert ex.conversation == _read(_write(tmp_path / "same.jsonl", [_record(17, 23)]))[0].conversation
