"""Bring your own task: verl-layout JSONL/parquet records, chat templates, the prompt-length
policy, and reward functions of one's own, from the record readers up to polyfsdp-train."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.own_data_cases import bpe_tokenizer, verl_record, write_jsonl, write_model_dir, write_parquet
from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.errors import ConfigError, DataError
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.data.sources import build_source, read_jsonl, read_parquet
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.data.tokenizers import CharTokenizer, HFTokenizerAdapter, load_tokenizer
from polyfsdp.trainer.train import main

TINY = ["trainer.sft_steps=1", "trainer.rl_steps=2", "trainer.sft_batch_size=4", "trainer.prompts_per_step=2",
        "algo.actor.group_size=2", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
        "trainer.checkpoint_interval=0"]
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return {"score": scale * float(ground_truth in solution_str), "chars": float(len(solution_str)),
            "index": float(extra_info["index"])}

def crash(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("checker exploded")
'''



CRASH_LINE = next(i for i, line in enumerate(REWARD_FILE.splitlines(), 1) if "checker exploded" in line)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("bpe") / "model")


def _rows(n, start=0, chat=True):
    return [verl_record(f"What is {i} plus {i}?", str(2 * i), chat=chat, index=i) for i in range(start, start + n)]


# ----------------------------------------------------------------------------- records


def test_verl_records_read_the_same_from_jsonl_and_parquet(tmp_path):
    rows = _rows(3)
    from_jsonl = read_jsonl(write_jsonl(tmp_path / "a.jsonl", rows))
    from_parquet = read_parquet(write_parquet(tmp_path / "a.parquet", rows))
    for a, b in zip(from_jsonl, from_parquet):
        assert (a.messages, a.answer, a.data_source, a.extra_info) == (b.messages, b.answer, b.data_source,
                                                                         b.extra_info)
    first = from_parquet[0]
    assert first.messages == ({"role": "user", "content": "What is 0 plus 0?"},)
    assert (first.answer, first.data_source, first.extra_info) == ("0", "toy", {"index": 0})
    assert first.where.endswith("a.parquet row 0") and from_jsonl[2].where.endswith("a.jsonl line 3")


def test_todays_prompt_answer_records_and_dotted_answer_keys_still_work(tmp_path):
    (today,) = read_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ab=", "answer": "ba"}]))
    assert (today.prompt, today.answer, today.messages) == ("ab=", "ba", None)
    rows = [{"q": {"text": "hi"}, "sol": {"final": 5}}]
    (custom,) = read_jsonl(write_jsonl(tmp_path / "c.jsonl", rows), prompt_key="q.text", answer_key="sol.final")
    assert (custom.prompt, custom.answer) == ("hi", "5")


@pytest.mark.parametrize("row,expected", [
    ({"prompt": [{"role": "user"}], "answer": "1"}, "line 2: field 'prompt' message 0 must be"),
    ({"prompt": [], "answer": "1"}, "line 2: field 'prompt' is an empty list of chat messages"),
    ({"prompt": "q", "reward_model": {"style": "rule"}}, "line 2: missing field 'answer' or 'reward_model.ground_truth'"),
    ({"prompt": "q", "answer": ["1"]}, "line 2: field 'answer' must be text"),
    ({"prompt": "q", "answer": "1", "extra_info": "x"}, "line 2: field 'extra_info' must be an object"),
    ({"prompt": "q", "answer": "1", "data_source": 3}, "line 2: field 'data_source' must be text"),
])
def test_a_malformed_record_is_one_line_naming_file_line_and_field(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(DataError) as info:
        read_jsonl(path)
    assert str(info.value).startswith(f"{path} {expected}") and "\n" not in str(info.value), str(info.value)


def test_a_malformed_parquet_row_names_the_row(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}])
    with pytest.raises(DataError, match=r"bad.parquet row 1: field 'prompt' must be text"):
        read_parquet(path)
    (tmp_path / "not.parquet").write_text("hello")
    with pytest.raises(DataError, match=r"not.parquet: not a readable parquet file"):
        read_parquet(str(tmp_path / "not.parquet"))


def test_mixed_train_files_and_val_files(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", _rows(3))
    b = write_jsonl(tmp_path / "b.jsonl", _rows(2, start=3))
    val = write_jsonl(tmp_path / "val.jsonl", _rows(2, start=10))
    cfg = load_config(["data=files", f"data.train_files=[{a},{b}]", f"data.val_files=[{val}]"])
    source = build_source(cfg.data, seed=0)
    assert [ex.answer for ex in source.train_examples] == ["0", "2", "4", "6", "8"]  # every train record
    assert [ex.answer for ex in source.eval_examples] == ["20", "22"]
    # Without validation files the tail is held out, as before.
    cfg = load_config(["data=files", f"data.train_files=[{a},{b}]", "data.eval_size=2"])
    source = build_source(cfg.data, seed=0)
    assert [ex.answer for ex in source.eval_examples] == ["6", "8"]


@pytest.mark.parametrize("overrides,expected", [
    (["data=files"], "data.train_files: a value is required"),
    (["data=files", "data.train_files=[]"], "data.train_files: expected a list of file paths"),
    (["data.train_files=[a.jsonl]"], "data.train_files/val_files: data=builtin does not read files"),
    (["data=jsonl", "data.path=a.jsonl", "data.train_files=[b.jsonl]"], "data.path / data.train_files: give one"),
    (["data.overlong=drop"], "data.overlong: got 'drop'; allowed values: filter, error, truncate"),
    (["data.max_prompt_length=0"], "data.max_prompt_length: expected an int >= 1, got 0"),
    (["reward.kwargs.x=1"], "reward.kwargs.x: unknown key"),
])
def test_data_and_reward_config_mistakes_are_one_line(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert str(info.value).startswith(expected), str(info.value)


def test_a_missing_data_file_or_unknown_extension_is_a_data_error(tmp_path):
    cfg = load_config(["data=files", f"data.train_files=[{tmp_path / 'nope.jsonl'}]"])
    with pytest.raises(DataError, match=r"data.train_files: '.*nope.jsonl' is not a file"):
        build_source(cfg.data, seed=0)
    (tmp_path / "d.csv").write_text("x")
    cfg = load_config(["data=files", f"data.train_files=[{tmp_path / 'd.csv'}]"])
    with pytest.raises(DataError, match=r"unknown file type; expected .jsonl, .json, .parquet"):
        build_source(cfg.data, seed=0)


# ----------------------------------------------------------------------------- prompts


def test_chat_prompts_are_exactly_the_templates_tokens(tmp_path, model_dir):
    tok = load_tokenizer(str(model_dir))
    assert isinstance(tok, HFTokenizerAdapter)
    records = read_jsonl(write_jsonl(tmp_path / "d.jsonl", _rows(2) + _rows(1, start=5, chat=False)))
    encoder = PromptEncoder(tok)
    chat, plain = encoder.encode(records[0]), encoder.encode(records[2])
    assert list(chat.prompt_ids) == tok.tok.apply_chat_template([dict(m) for m in records[0].messages],
                                                                add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)
    assert list(plain.prompt_ids) == tok.encode("What is 5 plus 5?")  # a string prompt as is (no bos here)
    # data.apply_chat_template=true renders a string prompt as one user message.
    templated = PromptEncoder(tok, apply_chat_template=True).encode(records[2])
    assert list(templated.prompt_ids) == tok.apply_chat_template([{"role": "user", "content": "What is 5 plus 5?"}])


def test_chat_prompt_with_a_tokenizer_without_template_names_file_and_fix(tmp_path):
    tok = HFTokenizerAdapter(bpe_tokenizer(chat_template=None))
    (record,) = read_jsonl(write_jsonl(tmp_path / "chat.jsonl", _rows(1)))
    with pytest.raises(DataError) as info:
        PromptEncoder(tok, model_path="/m").encode(record)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'chat.jsonl'} line 1: prompt is a list of chat messages, but the "
                              f"tokenizer of model.path=/m has no chat template; add a chat_template")


def test_overlong_prompts_are_filtered_refused_or_left_truncated(tmp_path, caplog):
    rows = [{"prompt": "a" * n, "answer": "x"} for n in (3, 9, 4, 12)]
    records = read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows))
    tok = CharTokenizer()  # <bos> + one token per character
    with caplog.at_level("INFO", logger="polyfsdp.trainer.data.chat"):
        kept = PromptEncoder(tok, max_prompt_length=5).encode_split(records, "train")
    assert [len(ex.prompt_ids) for ex in kept] == [4, 5]
    assert "filtered 2 of 4 train prompts" in caplog.text
    with pytest.raises(DataError) as info:
        PromptEncoder(tok, max_prompt_length=5, overlong="error").encode_split(records, "train")
    assert str(info.value).startswith(f"{tmp_path / 'd.jsonl'} line 2: prompt has 10 tokens, more than "
                                      f"data.max_prompt_length=5")
    cut = PromptEncoder(tok, max_prompt_length=5, overlong="truncate").encode_split(records, "train")
    assert [len(ex.prompt_ids) for ex in cut] == [4, 5, 5, 5]
    assert list(cut[1].prompt_ids) == tok.encode("aaaaa")  # the end is kept, <bos> with the start is cut


def test_a_prompt_longer_than_the_models_positions_is_refused_at_start(tmp_path, capsys):
    # 2000 characters on the 512-position preset used to run silently and very slowly.
    rows = [{"prompt": "ab" * 1000, "answer": "x"}] + [{"prompt": "ab", "answer": "ba"}] * 3
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    code = main([*TINY, "data=jsonl", f"data.path={path}", "data.eval_size=1",
                 f"trainer.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{path} line 1: prompt of 2001 tokens + algo.actor.max_new_tokens=8 needs 2009 positions, but the model " \
           f"has max_position_embeddings=512; set data.max_prompt_length=504" in err[0], err[0]
    assert not (tmp_path / "out" / "init_model").exists()
    # The fix it names works: the long prompt is filtered and the run trains.
    code = main([*TINY, "data=jsonl", f"data.path={path}", "data.eval_size=1", "data.max_prompt_length=504",
                 f"trainer.output_dir={tmp_path / 'out2'}"])
    assert code == 0


# ----------------------------------------------------------------------------- end to end


def test_grpo_on_verl_files_with_a_bpe_chat_model_and_a_reward_file(tmp_path, model_dir, monkeypatch):
    from polyfsdp.trainer.rollout import generate as generate_module

    train = write_parquet(tmp_path / "train.parquet", _rows(4))
    train2 = write_jsonl(tmp_path / "train2.jsonl", _rows(2, start=4))
    val = write_jsonl(tmp_path / "val.jsonl", _rows(2, start=20))
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    seen_prompts = []
    real_generate = generate_module.generate

    def spy(engine, prompts, *args, **kwargs):
        seen_prompts.extend(prompts)
        return real_generate(engine, prompts, *args, **kwargs)

    monkeypatch.setattr(generate_module, "generate", spy)
    out = tmp_path / "run"
    code = main([*TINY, f"model.path={model_dir}", "data=files", f"data.train_files=[{train},{train2}]",
                 f"data.val_files=[{val}]", f"reward.fn={tmp_path / 'my_reward.py'}:compute_score",
                 "reward.kwargs={scale:0.5}", "algo.actor.max_new_tokens=4", f"trainer.output_dir={out}"])
    assert code == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)  # what the user's own code would load
    expected = {tuple(tok.apply_chat_template([{"role": "user", "content": f"What is {i} plus {i}?"}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False))
                for i in list(range(6)) + [20, 21]}
    assert seen_prompts and {tuple(p) for p in seen_prompts} <= expected
    grpo = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl"]
    assert len(grpo) == 2
    for record in grpo:
        assert 0.0 <= record["reward"] <= 0.5
        assert record["reward/chars"] >= 0 and 0 <= record["reward/index"] <= 5  # train records only
    # Held-out evaluations log the reward's extra metrics too, averaged over the validation records.
    evals = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"]
    assert [r["tag"] for r in evals] == ["initial", "after_sft", "final"]
    assert all(r["reward/index"] == 20.5 and "reward/chars" in r for r in evals)


def test_arith_words_runs_the_chat_and_gsm8k_path_on_a_bpe_model(tmp_path, model_dir):
    out = tmp_path / "run"
    code = main([*TINY, f"model.path={model_dir}", "data=arith_words", "data.eval_size=4",
                 "algo.actor.max_new_tokens=6", f"trainer.output_dir={out}"])
    assert code == 0
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["tag"] for r in records if r["phase"] == "eval"] == ["initial", "after_sft", "final"]


def test_arith_words_problems_are_gsm8k_shaped_and_solved_by_their_answers():
    import random

    from polyfsdp.trainer.data.arith_words import ArithWordsTask
    from polyfsdp.trainer.rewards.rules import gsm8k

    task, rng, chars = ArithWordsTask(), random.Random(0), set(CharTokenizer().chars)
    for _ in range(300):
        ex = task.sample(rng)
        assert ex.messages == ({"role": "user", "content": ex.prompt},) and " #### " in ex.answer
        assert len(ex.answer) <= task.max_answer_chars and set(ex.prompt + ex.answer) <= chars
        assert gsm8k(ex.data_source, ex.answer, ex.answer, {}) == 1.0
        assert gsm8k(ex.data_source, ex.answer.split("####")[0], ex.answer, {}) == 1.0  # last number = result


def _cli(*args):
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu"}
    return subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("fn,expected", [
    # The user's file and line: where the reward raised.
    ("my_reward.py:crash", "reward.fn=my_reward.py:crash raised ValueError: checker exploded at {tmp}/my_reward.py:"
     f"{CRASH_LINE} (record "),
    ("my_reward.py:nope", "reward.fn=my_reward.py:nope: my_reward.py has no function 'nope'"),
])
def test_reward_failures_at_the_cli_are_one_line_without_traceback(tmp_path, fn, expected):
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab=", "answer": "ba"}] * 4)
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *TINY, "data=jsonl", f"data.path={data}",
                           "data.eval_size=1", f"reward.fn={fn}", f"trainer.output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "POLYFSDP_BACKEND": "cpu"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    expected = expected.replace("{tmp}", str(tmp_path))
    assert len(lines) == 1 and lines[0].startswith("polyfsdp-train: error: " + expected), proc.stderr
    if "nope" in fn:  # found before any model was built
        assert not (tmp_path / "out" / "init_model").exists()
