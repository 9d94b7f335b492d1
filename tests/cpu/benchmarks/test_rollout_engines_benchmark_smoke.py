"""The rollout-engine benchmark runs end to end (--quick) and prints a row per engine; with
vLLM installed it includes vLLM and the sync table."""
import importlib.util
import os
import sys

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_rollout_engine_benchmark_quick(capsys):
    import rollout_engines

    names = ["builtin", "hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    res = rollout_engines.main(["--quick", "--engines", *names, "--threads", "1"])
    out = capsys.readouterr().out
    assert set(res["tokens_per_s"]) == set(names) and all(v > 0 for v in res["tokens_per_s"].values())
    assert all(f"| {name} |" in out for name in names)
    assert bool(res["sync_s"]) == ("vllm" in names)
