"""benchmarks/compare_metrics.py: the before/after check of issue 25 ignores times and the RL
phase's old names, and fails on any other difference."""
import json
import os
import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "compare_metrics.py")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_times_and_old_phase_names_are_ignored_and_a_changed_number_is_not(tmp_path):
    before = _write(tmp_path / "a.jsonl", [{"phase": "grpo", "step": 1, "reward": 0.5, "step_time_s": 1.0,
                                            "tokens_per_s": 9.0}])
    same = _write(tmp_path / "b.jsonl", [{"phase": "rl", "step": 1, "reward": 0.5, "step_time_s": 2.0,
                                          "tokens_per_s": 3.0}])
    moved = _write(tmp_path / "c.jsonl", [{"phase": "rl", "step": 1, "reward": 0.25, "step_time_s": 2.0}])
    run = lambda a, b: subprocess.run([sys.executable, SCRIPT, a, b], capture_output=True, text=True)  # noqa: E731
    assert run(before, same).returncode == 0
    result = run(before, moved)
    assert result.returncode == 1 and "reward: 0.5 vs 0.25" in result.stdout
