"""benchmarks/async_rl.py: its summary of a run (medians over steps 3..N-1, train time, the
held-out reward at the asynchronous run's wall time) on made-up records, and with vLLM installed
(``pytest -m extended``: two polyfsdp-train jobs with a rollout server, ~2 minutes) the --quick run
end to end, printing its table."""
import os
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _records(step_s, gen_s, wait_s=None):
    records = [{"phase": "eval", "tag": "after_sft", "reward": 0.3, "time_s": 9.0}]
    t = 10.0
    for i, step in enumerate(step_s):
        t += step
        record = {"phase": "rl", "step": i + 1, "step_time_s": step, "gen_time_s": gen_s, "weight_sync_time_s": 0.1,
                  "time_s": t}
        if wait_s is not None:
            record.update({"async/trainer_wait_time_s": wait_s, "async/sampler_idle_time_s": 0.1,
                           "async/staleness": 1.0})
        records.append(record)
        if (i + 1) % 2 == 0:
            t += 0.5
            records.append({"phase": "eval", "tag": "final" if i + 1 == len(step_s) else "step",
                            "reward": 0.3 + 0.01 * (i + 1), "time_s": t})
    return records


def test_summary_and_the_reward_at_equal_wall_time():
    import async_rl

    sync = async_rl.summary(_records([5.0, 3.0, 2.0, 2.2, 2.4, 1.0], gen_s=1.0), k=0)
    # Steps 3..5 (the first two warm up, the last one is left out) but 3 and 5, which follow an
    # evaluation (it synced their weights): step 4 alone.
    assert sync["step_s"] == 2.2
    assert sync["train_s"] == pytest.approx(2.2 - 0.1 - 1.0)
    assert sync["evals"][0] == (0.0, 0.3) and sync["rl_wall_s"] == pytest.approx(15.6 + 1.5)
    fast = async_rl.summary(_records([4.0, 1.5, 1.2, 1.4, 1.3, 0.2], gen_s=1.0, wait_s=0.2), k=1)
    assert fast["step_s"] == 1.4 and fast["wait_s"] == 0.2 and fast["train_s"] == pytest.approx(1.4 - 0.1 - 0.2)
    # At the async run's wall time (its final evaluation, 10.6 s) the sync run's latest evaluation
    # is the one after its step 2 (8.5 s; the next comes at 13.2 s).
    assert async_rl.reward_at(fast["evals"], fast["rl_wall_s"]) == pytest.approx(0.36)
    assert async_rl.reward_at(sync["evals"], fast["rl_wall_s"]) == pytest.approx(0.32)


@pytest.mark.extended
def test_quick_run_prints_the_table(capsys, tmp_path):
    from tests.helpers.vllm_cases import require_vllm

    require_vllm()
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    import async_rl

    res = async_rl.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| sync (k=0) |" in out and "| async (k=1) |" in out and "async / sync step time" in out
    assert res["ratio"] > 0 and res["runs"]["async"][0]["staleness"] == 1
