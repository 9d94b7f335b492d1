"""The GRPO step benchmark and the step profiler run end to end (--quick); the TRL side
runs only when trl (the [bench] extra) is installed."""
import os
import sys

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_grpo_step_benchmark_quick_prints_the_table(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import grpo_step
    import trl_grpo

    res = grpo_step.main(["--quick", "--threads", "1"])
    out = capsys.readouterr().out
    row = res["rows"][0]
    # One update per rollout: ratio == 1 by construction, so no old-log-prob forward runs.
    assert row["polyfsdp"] > 0 and set(row["phases"]) == {"rollout", "train"}
    if trl_grpo.available():
        assert row["trl"] > 0 and "polyfsdp/TRL step time" in out
    else:
        assert "trl not installed" in out


def test_profile_step_quick_prints_the_op_table(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import profile_step

    phases = profile_step.main(["--quick", "--threads", "1", "--rows", "5"])
    assert set(phases) == {"rollout", "train"}
    assert "Self CPU" in capsys.readouterr().out


def test_generate_ranks_quick_runs_both_settings_on_one_rank(capsys):
    import generate_ranks

    per = generate_ranks.main(["--quick"])
    assert set(per) == {False, True} and all(v > 0 for v in per.values())
    assert "speed-up" in capsys.readouterr().out


def test_decode_vs_generate_runs_every_variant(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import decode_vs_generate

    times = decode_vs_generate.main(["--rounds", "1", "--prompts", "1", "--group", "2", "--new-tokens", "3",
                                     "--warm-steps", "0"])
    assert len(times) == 5 and all(len(t) == 1 and t[0] > 0 for t in times.values())
    assert "vs HF per round" in capsys.readouterr().out


def test_row_sampling_times_every_shape(capsys):
    import row_sampling

    ratios = row_sampling.main(["--rounds", "2", "--rows", "2", "3", "--vocab", "5", "--repeats", "20"])
    assert sorted(ratios) == [(5, 2), (5, 3)] and all(len(r) == 2 and min(r) > 0 for r in ratios.values())
    assert "row generators ms" in capsys.readouterr().out
