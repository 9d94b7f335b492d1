"""Rough edges a user meets training GRPO on a task of their own (found by trying one:
"sort these digits" with a system + user chat prompt and a reward file)."""
from __future__ import annotations

import pytest

from tests.helpers.ctrl_c import as_at_a_terminal
from tests.helpers.own_data_cases import write_jsonl
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.data.sources import build_source, check_tokenizer_covers
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.errors import DataError


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


def test_a_run_that_failed_before_training_may_be_rerun_with_a_fixed_reward(tmp_path, capsys):
    # The first run's reward raised at the initial evaluation, leaving only init_model and
    # config.yaml: rerunning in the same directory with the fix must not be refused as a
    # "continued run" with other reward or data settings (nothing was trained yet).

    from polyfsdp.trainer.train import main

    (tmp_path / "r.py").write_text(
        "def broken(data_source, solution_str, ground_truth, extra_info=None):\n    return int(solution_str)\n"
        "def fixed(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n")
    data = write_jsonl(tmp_path / "train.jsonl", _sort_rows(8))
    common = ["data=files", f"data.train_files=[{data}]", "data.eval_size=2", "trainer.sft_steps=1",
              "trainer.rl_steps=1", "trainer.sft_batch_size=2", "trainer.prompts_per_step=2",
              "algo.actor.group_size=2", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
              f"trainer.output_dir={tmp_path / 'out'}"]
    assert main([*common, f"reward.fn={tmp_path / 'r.py'}:broken"]) == 2
    assert "raised ValueError" in capsys.readouterr().err
    assert main([*common, f"reward.fn={tmp_path / 'r.py'}:fixed", "data.eval_size=3"]) == 0
    # What was trained stays protected: a changed model is still refused.
    assert main([*common, f"reward.fn={tmp_path / 'r.py'}:fixed", "model.seed=1"]) == 2
    assert "model.seed=0, but this run asks for model.seed=1" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--cfg"], ["--cfg", "job"], ["-c", "all"], ["--cfg=job"]])
def test_cfg_prints_the_reward_and_data_keys_in_hydras_spellings_too(flags, capsys):
    from polyfsdp.trainer.train import main

    assert main(["data=files", "data.train_files=[t.jsonl]", *flags, "reward.fn=my_reward.py:compute_score"]) == 0
    out = capsys.readouterr().out
    assert "fn: my_reward.py:compute_score" in out and "- t.jsonl" in out and "val_files: null" in out


def test_cfg_hydra_is_one_line_saying_what_to_use(capsys):
    from polyfsdp.trainer.train import main

    assert main(["--cfg", "hydra"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--cfg hydra" in err and "--cfg job" in err


CTRL_C_RUN = ["trainer.sft_steps=1000", "trainer.sft_batch_size=4", "trainer.checkpoint_interval=1",
              "trainer.progress=off", "data.eval_size=4"]


def test_ctrl_c_is_one_line_saying_how_to_continue(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "polyfsdp.trainer.train", *CTRL_C_RUN, f"trainer.output_dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "POLYFSDP_BACKEND": "cpu"}, preexec_fn=as_at_a_terminal)
    try:
        for line in proc.stdout:
            if line.startswith("checkpoint saved:"):
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    # The step it stopped after, the checkpoint it would continue from, and how.
    head, last, tail = lines[0].split("; ")
    assert head.startswith("polyfsdp-train: interrupted after sft step "), err
    done = int(head.rsplit(" ", 1)[1])
    assert last.startswith(f"last checkpoint {out / 'checkpoints' / 'sft'}/step_"), err
    assert int(last.rsplit("_", 1)[1]) in (done, done - 1)  # the signal may land during a save
    assert tail == "continue with: " + " ".join(["polyfsdp-train", *CTRL_C_RUN, f"trainer.output_dir={out}",
                                                 "trainer.resume=auto"]), err


def test_ctrl_c_under_a_pipe_that_dies_with_it_still_exits_130(tmp_path):
    """``polyfsdp-train ... 2>&1 | tee log``: the same Ctrl-C ends tee, so the stop line meets a
    closed pipe; the exit status must still be the interrupt's, not a broken pipe's."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "polyfsdp.trainer.train", *CTRL_C_RUN,
                             f"trainer.output_dir={tmp_path / 'out'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "POLYFSDP_BACKEND": "cpu"}, start_new_session=True,
                            preexec_fn=as_at_a_terminal)
    try:
        for line in proc.stdout:
            if line.startswith(b"checkpoint saved:"):
                break
        proc.stdout.close()  # tee is gone
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130


def test_continuing_with_fewer_steps_than_were_done_is_one_line(tmp_path, capsys):
    # It used to run no step and log a "final" evaluation at the lower global step.

    from polyfsdp.trainer.train import main

    common = ["trainer.sft_steps=1", "trainer.sft_batch_size=2", "trainer.prompts_per_step=2",
              "algo.actor.group_size=2", "data.eval_size=2", "trainer.progress=off", "trainer.plot=false",
              "trainer.export=false", "trainer.checkpoint_interval=1", f"trainer.output_dir={tmp_path / 'out'}"]
    assert main([*common, "trainer.rl_steps=3"]) == 0
    capsys.readouterr()
    assert main([*common, "trainer.rl_steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "trainer.rl_steps=2: " in err and "is already at rl step 3; set " \
        "trainer.rl_steps>=3 to continue it" in err, err


def test_relative_paths_that_miss_say_which_directory_they_were_read_from(tmp_path, monkeypatch):
    from polyfsdp.trainer.errors import ConfigError
    from polyfsdp.trainer.rewards.reward_fn import load_reward_fn

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"no such file 'r.py' in the working directory {tmp_path}$"):
        load_reward_fn("r.py:compute_score")
    cfg = load_config(["data=files", "data.train_files=[t.jsonl]"])
    with pytest.raises(DataError, match=rf"^data.train_files: 't.jsonl' is not a file in the working directory "
                                        rf"{tmp_path}$"):
        build_source(cfg.data, 0)


def test_a_file_no_larger_than_the_held_out_share_names_the_fix(tmp_path):
    # A user's first file is often a handful of records: the default data.eval_size (64) would
    # hold out all of them; the line says which two keys fix it.
    with pytest.raises(DataError, match=r"data.eval_size=2 are held out .*lower data.eval_size or give data=files "
                                        r"data.val_files=\[\.\.\.\]$"):
        _source(tmp_path, _sort_rows(2))
