"""The fused log-prob benchmark runs end to end on tiny shapes, checks outputs, and fails loudly."""
import importlib.util
import os
import subprocess
import sys

import torch

from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "fused_logprob.py")


def _load():
    spec = importlib.util.spec_from_file_location("fused_logprob_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_quick_run_prints_every_path_and_matches_the_reference():
    # The accelerator validation script's command line, on the CPU backend.
    done = subprocess.run([sys.executable, SCRIPT, "--device-backend", "cpu", "--check", "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    paths = {row[0] for row in rows if len(row) >= 6 and row[1] == "fwd+bwd"}
    assert paths == {"floor", "naive", "eager", "compiled", "eager-loss", "compiled-loss"}, done.stdout
    assert "ERROR" not in done.stdout
    assert "match the float64 reference" in done.stdout


def test_a_crashing_child_exits_non_zero():
    done = subprocess.run([sys.executable, SCRIPT, "--device-backend", "cpu", "--quick", "--threads", "1",
                           "--paths", "bogus"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "CRASHED bogus fwd+bwd" in done.stdout and "impl must be one of" in done.stdout


def test_comparison_flags_a_wrong_gradient_and_passes_the_right_one():
    bench = _load()
    g = torch.Generator().manual_seed(0)
    lp, ent, gh, gw = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((6,), (6,), (6, 4), (9, 4)))
    reference = bench._summary(lp, ent, gh, gw)
    assert bench._compare("same", bench._summary(lp.float(), ent.float(), gh.float(), gw.float()), reference) == []
    wrong = gw.clone()
    wrong[3, 1] += 0.01 * gw.abs().max()
    problems = bench._compare("bad", bench._summary(lp, ent, gh, wrong), reference)
    assert problems and all(p.startswith("bad: ") and "grad_weight" in p for p in problems)
    nan_lp = lp.clone()
    nan_lp[0] = float("nan")
    assert bench._compare("nan", bench._summary(nan_lp, ent, gh, gw), reference)[0].startswith("nan: log_probs")


def test_check_names_the_row_that_misses_a_target():
    bench = _load()

    def results(compiled_s, compiled_mem):
        return {("floor", "fwd+bwd"): {"median_s": 1.0, "peak_extra_bytes": 0},
                ("naive", "fwd+bwd"): {"median_s": 1.5, "peak_extra_bytes": 800},
                ("compiled", "fwd+bwd"): {"median_s": compiled_s, "peak_extra_bytes": compiled_mem}}

    assert bench._check_targets(bench.SHAPE, results(1.1, 90)) == []
    slow = bench._check_targets(bench.SHAPE, results(1.3, 90))
    assert len(slow) == 1 and slow[0].startswith("compiled fwd+bwd at (2048, 1024, 32768): 1.30x the floor")
    big = bench._check_targets(bench.LARGE, results(1.25, 200))
    assert len(big) == 1 and "extra peak 0.250 of naive" in big[0]
    assert bench._check_targets(bench.TINY, results(9.0, 800)) == []  # no target at the smoke shape


def test_check_names_a_slow_loss_in_forward_row():
    bench = _load()

    def results(loss_s, compiled_s=1.1):
        return {("floor", "fwd+bwd"): {"median_s": 1.0, "peak_extra_bytes": 0},
                ("naive", "fwd+bwd"): {"median_s": 1.5, "peak_extra_bytes": 800},
                ("compiled", "fwd+bwd"): {"median_s": compiled_s, "peak_extra_bytes": 90},
                ("compiled-loss", "fwd+bwd"): {"median_s": loss_s, "peak_extra_bytes": 90}}

    assert bench._check_targets(bench.SHAPE, results(1.1)) == []
    slow = bench._check_targets(bench.SHAPE, results(1.18))
    assert slow == ["compiled-loss fwd+bwd at (2048, 1024, 32768): 1.18x the floor > target 1.15x"]
    assert bench._check_targets(bench.LARGE, results(1.2, compiled_s=1.25)) == []
    slower = bench._check_targets(bench.LARGE, results(1.3, compiled_s=1.25))
    assert len(slower) == 1 and "1.04x the compiled path's time" in slower[0]
