"""The padding-free benchmark runs end to end (--quick) and prints its ratio table."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def test_padding_free_benchmark_quick_prints_every_mode(capsys):
    import padding_free

    res = padding_free.main(["--quick"])
    out = capsys.readouterr().out
    for rmpad, fused in padding_free.MODES:
        assert padding_free.mode_name(rmpad, fused) in out
        assert all(v > 0 for v in res["best"][(rmpad, fused)].values())
    assert "remove-padding speed-up" in out
