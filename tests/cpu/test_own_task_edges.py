"""Rough edges a user meets training GRPO on a task of their own (found by trying one:
"sort these digits" with a system + user chat prompt and a reward file)."""
from __future__ import annotations

import pytest

from own_data_cases import write_jsonl
from polyfsdp.trainer.config import load_config
from polyfsdp.trainer.data import DataError, build_source, check_tokenizer_covers
from polyfsdp.trainer.task import CharTokenizer


def _sort_rows(n, system=True):
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Sort {i}{9 - i % 10}1"}]
        if system:
            messages.insert(0, {"role": "system", "content": "You sort digits."})
        rows.append({"data_source": "sort_digits", "prompt": messages,
                     "reward_model": {"ground_truth": "".join(sorted(f"{i}{9 - i % 10}1"))}, "extra_info": {"i": i}})
    return rows


def _source(tmp_path, rows, *overrides):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = load_config(["data=files", f"data.train_files=[{path}]", "data.eval_size=2", *overrides])
    return build_source(cfg.data, 0)


def test_a_multi_message_chat_prompt_passes_the_character_tokenizer_check(tmp_path):
    # The messages are rendered "[role] content "; the newline joining them in Example.prompt
    # is never tokenized, so it must not be reported as a character the tokenizer lacks.
    check_tokenizer_covers(_source(tmp_path, _sort_rows(6)), CharTokenizer())


def test_characters_outside_the_tokenizer_name_the_key_the_user_set(tmp_path):
    rows = _sort_rows(6, system=False)
    rows[1]["prompt"][0]["content"] = "Sort 50%"
    with pytest.raises(DataError, match=r"^data.train_files .*train.jsonl: '%' .*not in the character tokenizer"):
        check_tokenizer_covers(_source(tmp_path, rows), CharTokenizer())
