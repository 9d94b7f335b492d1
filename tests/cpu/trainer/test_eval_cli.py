"""polyfsdp-eval: a run's export scores the held-out number the run printed (greedy); sampled
settings and validation rows come out in the JSON; a model directory outside a run uses the
defaults; mistakes are one line."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys

import pytest

from polyfsdp.trainer.eval_cli import main as eval_main
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main as train_main

TINY = ["trainer.sft_steps=8", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
        "data.eval_size=8", "trainer.progress=off", "algo.actor.group_size=4", "trainer.plot=false",
        "trainer.checkpoint_interval=100",  # one checkpoint per phase, at its end
        "trainer.eval_interval=1"]  # and one held-out evaluation in the middle of RL (after its step 1)


@pytest.fixture(scope="module")
def run_and_lines(tmp_path_factory):
    out = tmp_path_factory.mktemp("evalcli") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train_main([*TINY, f"trainer.output_dir={out}"]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def exported_run(run_and_lines):
    out, _ = run_and_lines
    evals = {r["tag"]: r["reward"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"}
    return out, evals["final"]


def test_the_mid_run_held_out_line_names_the_rl_step(run_and_lines):
    out, lines = run_and_lines
    # RL step 1 of 2 is global step 9 (after 8 SFT steps); metrics.jsonl keeps the tag "step".
    assert "held-out reward (rl step 1, global step 9, 8 prompts" in lines, lines
    tags = [r["tag"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"]
    assert tags == ["initial", "after_sft", "step", "final"]


def test_the_export_reproduces_the_runs_final_held_out_reward(exported_run, tmp_path, capsys):
    out, printed = exported_run
    assert eval_main([str(out / "final"), "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_prompts"] == 8 and report["reward_fn"] == "char_match"
    assert report["metrics"]["reward"] == printed and printed > 0
    assert f"reward  {printed:.4f}" in capsys.readouterr().out


def test_training_checkpoints_score_what_the_run_printed_at_their_step(exported_run, tmp_path):
    out, printed = exported_run
    evals = {r["tag"]: r["reward"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"}
    assert evals["after_sft"] != evals["final"]  # the two checkpoints are told apart
    checkpoints = out / "checkpoints"
    for path, tag in ((checkpoints / "sft" / "step_000008", "after_sft"), (checkpoints / "rl", "final")):
        assert eval_main([str(path), "--json", str(tmp_path / f"{tag}.json")]) == 0
        assert json.loads((tmp_path / f"{tag}.json").read_text())["metrics"]["reward"] == evals[tag], tag


def test_the_policy_is_named_after_what_is_evaluated(exported_run, tmp_path, capsys):
    out, _ = exported_run
    for path, label in ((out / "final", "rl policy"), (out / "sft_model", "sft policy"),
                        (out / "checkpoints" / "sft", "sft policy"), (out / "checkpoints" / "rl", "rl policy")):
        assert eval_main([str(path), "--json", str(tmp_path / f"{path.name}.json")]) == 0
        printed = capsys.readouterr().out
        assert f"[{label}] trainable parameters: " in printed and printed.count("trainable parameters") == 1, \
            (path, printed)


def test_results_go_next_to_what_was_evaluated_not_to_the_working_directory(exported_run, tmp_path, monkeypatch,
                                                                            capsys):
    out, printed = exported_run
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(out / "eval", ignore_errors=True)
    assert eval_main([str(out / "final")]) == 0
    assert eval_main([str(out / "checkpoints" / "rl")]) == 0  # its newest: step 2
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["checkpoints_rl_step_000002.json", "final.json"]
    final = json.loads((out / "eval" / "final.json").read_text())
    assert final["metrics"]["reward"] == printed and final["evaluated"] == str(out / "final")
    assert f"results: {out / 'eval' / 'final.json'}" in capsys.readouterr().out
    shutil.copytree(out / "final", tmp_path / "model")
    assert eval_main([str(tmp_path / "model"), "data.eval_size=8"]) == 0
    assert (tmp_path / "model.eval.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.eval.json"]  # nothing else in the cwd


def test_another_models_results_are_never_overwritten(exported_run, tmp_path, capsys):
    out, _ = exported_run
    results = tmp_path / "r.json"
    assert eval_main([str(out / "final"), "--json", str(results)]) == 0
    kept = results.read_text()
    assert eval_main([str(out / "checkpoints" / "sft"), "--json", str(results)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"polyfsdp-eval: error: --json {results}: it holds the results of {out / 'final'}; name another "
                     f"file with --json FILE or remove it")
    assert results.read_text() == kept
    assert eval_main([str(out / "final"), "eval.n_samples=2", "eval.temperature=1.0", "--json", str(results)]) == 0
    assert json.loads(results.read_text())["eval"]["n_samples"] == 2  # the same model's results: replaced
    (tmp_path / "notes.json").write_text("{}")
    assert eval_main([str(out / "final"), "--json", str(tmp_path / "notes.json")]) == 2
    assert "a file that is not this model's results" in capsys.readouterr().err


def test_sampled_settings_and_generations_reach_the_json(exported_run, tmp_path):
    out, _ = exported_run
    assert eval_main([str(out / "final"), "eval.n_samples=2", "eval.temperature=1.0",
                      "trainer.log_val_generations=3", f"--json={tmp_path / 'r.json'}"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    metrics = report["metrics"]
    assert set(metrics) == {"reward", "mean@2", "pass@1", "pass@2", "maj@2"}
    assert metrics["pass@1"] <= metrics["pass@2"] and report["eval"]["n_samples"] == 2
    assert [set(row) for row in report["generations"]] == [{"prompt", "completion", "ground_truth", "reward"}] * 3


def test_a_model_directory_outside_a_run_uses_the_default_config(exported_run, tmp_path):
    out, printed = exported_run
    shutil.copytree(out / "final", tmp_path / "model")
    # The defaults' held-out prompts are the run's (same seed), the first data.eval_size of them.
    assert eval_main([str(tmp_path / "model"), "data.eval_size=8", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["metrics"]["reward"] == printed


@pytest.mark.parametrize("args,expected", [
    (["{tmp}/missing"], "is not a directory"),
    (["{final}", "eval.n_sample=3"], "eval.n_sample: unknown key"),
    (["{final}", "eval.n_samples=3"], "eval.n_samples=3: greedy completions"),
    (["eval.n_samples=3"], "the first argument is MODEL_DIR"),
    (["{final}", "--json", "{tmp}/no/such/dir/r.json"], "cannot write it"),
])
def test_mistakes_are_one_line(exported_run, tmp_path, monkeypatch, capsys, args, expected):
    """In this process (a child interpreter per case took 15-25 s on a loaded CI machine); the
    command itself, its exit status and its whole stderr, is the next test's."""
    out, _ = exported_run
    args = [a.format(tmp=tmp_path, final=out / "final") for a in args]
    monkeypatch.chdir(tmp_path)
    code = eval_main(args)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("polyfsdp-eval: error: ") and expected in lines[0], lines[0]


def test_the_command_says_a_mistake_in_one_line_and_exits_2(exported_run, tmp_path):
    out, _ = exported_run
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.eval_cli", str(out / "final"), "eval.n_sample=3"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("polyfsdp-eval: error: ") and "eval.n_sample: unknown key" in lines[0], lines[0]


def test_an_adapter_export_is_one_line_pointing_at_the_runs_checkpoint(tmp_path, capsys):
    # trainer.export_lora=adapter writes a peft directory without config.json: nothing to build.
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "adapter_config.json").write_text("{}")
    assert eval_main([str(tmp_path / "final")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "LoRA adapters only" in err and "RUN/checkpoints/rl" in err, err
