"""``polyfsdp-eval RUN/final`` started elsewhere than the run: the relative data paths of the run's
config.yaml are read from where the run started (RUN/started_in.json, trainer/config/run_start.py),
a path typed on the eval command line from the caller's directory; a record naming a directory that
is not here falls back to the working directory with one line; the record makes no code importable;
a checkpoint of a run on a relative model.path loads into that model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.helpers.own_data_cases import write_model_dir

from polyfsdp.trainer.eval_cli import main as eval_main
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main as train_main

TINY = ["trainer.sft_steps=2", "trainer.rl_steps=1", "trainer.sft_batch_size=4", "trainer.prompts_per_step=4",
        "algo.actor.group_size=4", "data.eval_size=8", "trainer.progress=off", "trainer.plot=false"]
WORDS = ["abc", "bad", "cafe", "dab", "face", "bead", "fade", "ace", "cab", "deaf", "bed", "fad"]


def write_rows(path, words):
    path.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n" for w in words))


@pytest.fixture(scope="module")
def started_run(tmp_path_factory):
    """A run started in ``project/`` on its relative train.jsonl and val.jsonl: (run, project, final reward)."""
    project = tmp_path_factory.mktemp("start_dir") / "project"
    project.mkdir()
    write_rows(project / "train.jsonl", WORDS * 2)
    write_rows(project / "val.jsonl", WORDS[:8])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(project)
        assert train_main([*TINY, "data=files", "data.train_files=[train.jsonl]", "data.val_files=[val.jsonl]",
                           "trainer.output_dir=runs/a"]) == 0
    run = project / "runs" / "a"
    final = [r["reward"] for r in read_metrics(str(run / "metrics.jsonl")) if r.get("tag") == "final"]
    return run, project, final[-1]


def test_the_run_records_where_it_started(started_run):
    run, project, _ = started_run
    assert json.loads((run / "started_in.json").read_text()) == {"working_directory": str(project)}


def test_evaluated_from_elsewhere_it_reads_the_runs_data_and_scores_what_the_run_printed(started_run, tmp_path,
                                                                                          monkeypatch, capsys):
    run, project, printed = started_run
    monkeypatch.chdir(tmp_path)  # no train.jsonl or val.jsonl here
    assert eval_main([str(run / "final"), "--json", "r.json"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["metrics"]["reward"] == printed > 0 and report["num_prompts"] == 8
    assert report["data"]["train_files"] == [str(project / "train.jsonl")]
    assert "started in" not in capsys.readouterr().out  # the record was found: nothing to say


def test_a_path_on_the_command_line_is_the_callers_own(started_run, tmp_path, monkeypatch):
    run, project, _ = started_run
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "val.jsonl", WORDS[:5])  # the caller's val.jsonl, not the run's (8 rows)
    assert eval_main([str(run / "final"), "data.val_files=[val.jsonl]", "--json", "r.json"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_prompts"] == 5 and report["data"]["val_files"] == ["val.jsonl"]
    assert report["data"]["train_files"] == [str(project / "train.jsonl")]  # not given: still the run's


def test_a_start_directory_not_on_this_machine_falls_back_to_the_working_directory(started_run, tmp_path,
                                                                                  monkeypatch, capsys):
    run, project, printed = started_run
    downloaded = tmp_path / "downloaded"
    shutil.copytree(run, downloaded, ignore=shutil.ignore_patterns("eval"))
    (downloaded / "started_in.json").write_text(json.dumps({"working_directory": str(tmp_path / "gone")}))
    here = tmp_path / "here"
    here.mkdir()
    for name in ("train.jsonl", "val.jsonl"):
        shutil.copy(project / name, here)
    monkeypatch.chdir(here)
    assert eval_main([str(downloaded / "final"), "--json", "r.json"]) == 0
    assert json.loads((here / "r.json").read_text())["metrics"]["reward"] == printed
    said = [line for line in capsys.readouterr().out.splitlines() if "started in" in line]
    assert said == [f"polyfsdp-eval: the run was started in {tmp_path / 'gone'}, which is not a directory on this "
                    f"machine: the relative paths of its config.yaml (data.train_files, data.val_files) are read "
                    f"from the working directory {here}"], said


def _copy_with_saved_value(run: Path, copy: Path, line: str, replacement: str) -> Path:
    """``run`` copied to ``copy`` (without its eval results) with one saved config line replaced."""
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval"))
    config = (copy / "config.yaml").read_text()
    assert line in config
    (copy / "config.yaml").write_text(config.replace(line, replacement))
    return copy


def test_the_start_directory_makes_no_code_importable(started_run, tmp_path, monkeypatch, capsys):
    run, project, _ = started_run
    crafted = _copy_with_saved_value(run, tmp_path / "crafted", "fn: auto", "fn: authors_code.py:score")
    marker = tmp_path / "imported"
    (project / "authors_code.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                             "def score(*args, **kwargs):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)  # no authors_code.py here: only the recorded directory holds it
    assert eval_main([str(crafted / "final"), "--json", "r.json"]) == 2
    assert not marker.exists() and "names code to import (reward.fn=authors_code.py:score)" in capsys.readouterr().err
    # Trusted, the relative file is the one beside the run's data, where the run found it.
    assert eval_main([str(crafted / "final"), "--json", "r.json", "--trust-run-code"]) == 0
    assert marker.exists() and json.loads((tmp_path / "r.json").read_text())["metrics"]["reward"] == 0.0


def test_a_checkpoint_of_a_run_on_a_relative_model_path_loads_into_that_model(tmp_path, monkeypatch):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_model_dir(project / "my_model")
    monkeypatch.chdir(project)
    # algo=sft: its checkpoints load into the run's starting model, model.path (eval_cli.eval_config).
    sft_only = [o for o in TINY if not o.startswith(("algo.actor.", "trainer.rl_steps"))]
    # The built-in model's SFT rate (a model.path takes a pretrained model's 1e-5): the tiny model learns
    # enough for a nonzero reward to compare.
    assert train_main([*sft_only, "algo=sft", "model.path=my_model", "algo.sft.optim.lr=3e-3",
                       "trainer.output_dir=runs/a"]) == 0
    run = project / "runs" / "a"
    printed = [r["reward"] for r in read_metrics(str(run / "metrics.jsonl")) if r.get("tag") == "final"][-1]
    monkeypatch.chdir(elsewhere)
    assert eval_main([str(run / "checkpoints" / "sft"), "--json", "r.json"]) == 0
    assert json.loads((elsewhere / "r.json").read_text())["metrics"]["reward"] == printed > 0


def test_the_checkpoint_a_run_was_resumed_from_is_not_needed_to_evaluate_it(started_run, tmp_path, monkeypatch):
    run, _, printed = started_run
    # As a run started with trainer.resume=runs/old/checkpoints/rl/step_000001 saves it: relative, since pruned.
    resumed = _copy_with_saved_value(run, tmp_path / "resumed", "resume: auto",
                                     "resume: runs/old/checkpoints/rl/step_000001")
    monkeypatch.chdir(tmp_path)
    assert eval_main([str(resumed / "final"), "--json", "r.json"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["metrics"]["reward"] == printed
