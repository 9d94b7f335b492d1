"""The padding-free benchmark runs end to end (--quick), prints its ratio table, checks every mode
against its reference, and reports (exit 1 from the command line) a mode that does not match."""
import os
import sys

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_padding_free_benchmark_quick_prints_every_mode_and_matches_the_reference(capsys):
    import padding_free

    res = padding_free.main(["--quick", "--device-backend", "cpu"])
    out = capsys.readouterr().out
    assert res["backend"] == "cpu" and res["failures"] == []
    for rmpad, fused in padding_free.MODES:
        assert padding_free.mode_name(rmpad, fused) in out
        assert all(v > 0 for v in res["best"][(rmpad, fused)].values())
        errors = res["errors"][(rmpad, fused)]
        assert set(errors) == {"infer log_probs", "infer entropy", "train log_probs", "train entropy"}
        assert max(errors.values()) <= 1e-5  # fp32 vs fp32 eager reference on CPU (measured 1.4e-6)
    assert "remove-padding speed-up" in out and "within 0.001 of the reference" in out


def test_padding_free_benchmark_fails_on_a_reference_mismatch(monkeypatch, capsys):
    # Negative control: a reference at temperature 0.9 instead of 1 must fail every mode.
    import padding_free

    real = padding_free.reference_logprobs
    monkeypatch.setattr(padding_free, "reference_logprobs",
                        lambda model, seqs, temps: real(model, seqs, [0.9] * len(seqs)))
    res = padding_free.main(["--quick", "--device-backend", "cpu"])
    assert len(res["failures"]) == 16  # 4 modes x (infer, train) x (log-probs, entropy)
    out = capsys.readouterr().out
    assert f"FAIL {padding_free.mode_name(True, True)} infer log_probs: max |err|" in out
    assert min(float(line.split("max |err| ")[1].split()[0]) for line in res["failures"]) > 10 * padding_free.REFERENCE_TOL


def test_padding_free_check_names_the_row_that_misses_its_target():
    import padding_free

    best = {mode: {"infer": 1.0, "train": 1.0, "infer_cpu": 1.0, "train_cpu": 1.0} for mode in padding_free.MODES}
    best[(True, False)] = {"infer": 0.5, "train": 0.8, "infer_cpu": 0.5, "train_cpu": 0.8}
    res = {"backend": "cpu", "best": best, "errors": {mode: {"infer log_probs": 0.0} for mode in padding_free.MODES}}
    assert padding_free.failures(res, check_targets=True) == [
        "FAIL rmpad  unfused train: remove-padding speed-up 1.25x < target 1.6x"]
    assert padding_free.failures(res, check_targets=False) == []
    assert padding_free.failures({**res, "backend": "cuda"}, check_targets=True) == []  # no measured target
