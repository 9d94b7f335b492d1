"""polyfsdp-eval: a run's export scores the held-out number the run printed (greedy); sampled
settings and validation rows come out in the JSON; a model directory outside a run uses the
defaults; mistakes are one line."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from polyfsdp.trainer.eval_cli import main as eval_main
from polyfsdp.trainer.metrics import read_metrics
from polyfsdp.trainer.train import main as train_main

TINY = ["trainer.sft_steps=8", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
        "data.eval_size=8", "trainer.progress=off", "algo.actor.group_size=4", "trainer.plot=false",
        "trainer.checkpoint_interval=100"]  # one checkpoint per phase, at its end


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evalcli") / "run"
    assert train_main([*TINY, f"trainer.output_dir={out}"]) == 0
    evals = {r["tag"]: r["reward"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"}
    return out, evals["final"]


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
        assert eval_main([str(path), "--json", str(tmp_path / "r.json")]) == 0
        assert json.loads((tmp_path / "r.json").read_text())["metrics"]["reward"] == evals[tag], tag


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
def test_mistakes_are_one_line(exported_run, tmp_path, args, expected):
    out, _ = exported_run
    args = [a.format(tmp=tmp_path, final=out / "final") for a in args]
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.eval_cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("polyfsdp-eval: error: ") and expected in lines[0], lines[0]
