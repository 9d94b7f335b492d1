"""A preset's character tokenizer learns the data's characters before its model is built
(trainer/data/chat.py PromptEncoder.learn_characters), so user text is never cut to <unk>."""
import json
import subprocess
import sys

from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.data.sources import build_source, check_tokenizer_covers
from polyfsdp.trainer.data.tokenizers import CharTokenizer

ROWS = [{"prompt": f"What is {i}% of 200?\n", "answer": f"{2 * i} é"} for i in range(1, 9)]
ROWS.append({"prompt": [{"role": "user", "content": "Say “hi” ≠ bye"}], "answer": "hi"})


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _source(tmp_path, grow):
    cfg = load_config(["data=files", f"data.train_files=[{_write(tmp_path / 'train.jsonl', ROWS)}]",
                       "data.eval_size=2"])
    tokenizer = CharTokenizer()
    encoder = PromptEncoder(tokenizer, grow_vocabulary=grow)
    return build_source(cfg.data, 0, encoder), tokenizer, encoder


def test_a_fresh_character_tokenizer_adds_the_datas_characters_in_sorted_order(tmp_path):
    source, tokenizer, encoder = _source(tmp_path, grow=True)
    assert set(encoder.added_characters) == set("%\né“”≠")
    assert list(encoder.added_characters) == sorted(encoder.added_characters)
    assert tokenizer.chars.startswith(CharTokenizer().chars)  # existing ids keep their meaning
    check_tokenizer_covers(source, tokenizer)  # nothing left to become <unk>
    for ex in source.train_examples + source.eval_examples:
        assert tokenizer.unk_token_id not in ex.prompt_ids
    # The same data gives the same vocabulary (every rank, and a continued run, agree).
    _, again, _ = _source(tmp_path, grow=True)
    assert again.chars == tokenizer.chars


def test_a_fixed_tokenizer_still_names_what_it_lacks(tmp_path):
    import pytest

    from polyfsdp.trainer.errors import DataError

    source, tokenizer, encoder = _source(tmp_path, grow=False)
    assert encoder.added_characters == "" and tokenizer.chars == CharTokenizer().chars
    with pytest.raises(DataError, match="not in the character tokenizer"):
        check_tokenizer_covers(source, tokenizer)


def test_polyfsdp_train_runs_on_text_outside_the_default_characters_and_continues(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "polyfsdp.trainer.train", "data=files",
            f"data.train_files=[{_write(tmp_path / 'train.jsonl', ROWS)}]", "data.eval_size=2",
            f"trainer.output_dir={out}", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
            "trainer.sft_steps=2", "trainer.sft_batch_size=4", "trainer.prompts_per_step=2", "algo.actor.group_size=2",
            "algo.actor.max_new_tokens=4", "trainer.eval_interval=0", "trainer.checkpoint_interval=1"]
    first = subprocess.run(args + ["trainer.rl_steps=1"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "character tokenizer: added the data's characters" in first.stdout
    saved = json.loads((out / "init_model" / "char_tokenizer.json").read_text())
    config = json.loads((out / "init_model" / "config.json").read_text())
    assert set("%é≠") <= set(saved["chars"]) and config["vocab_size"] == len(saved["vocab"])
    # A continued run reads the vocabulary its initial model was built with.
    more = subprocess.run(args + ["trainer.rl_steps=2", "trainer.resume=auto"], capture_output=True, text=True,
                          timeout=300)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "character tokenizer: added" not in more.stdout


def test_continuing_a_run_with_data_holding_new_characters_is_one_line(tmp_path):
    out = tmp_path / "run"
    base = [sys.executable, "-m", "polyfsdp.trainer.train", "data=files", "data.eval_size=2",
            f"trainer.output_dir={out}", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
            "algo=sft", "trainer.sft_steps=1", "trainer.sft_batch_size=2"]
    first = subprocess.run(base + [f"data.train_files=[{_write(tmp_path / 'a.jsonl', ROWS[:4])}]"],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    rows = ROWS[:4] + [{"prompt": "2 ∑ 3", "answer": "5"}]
    again = subprocess.run(base + [f"data.train_files=[{_write(tmp_path / 'a.jsonl', rows)}]"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode != 0
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "'∑'" in lines[0] and "initial model" in lines[0], again.stderr[-2000:]
