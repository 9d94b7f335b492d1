"""What a resumed RL run says once, and only once: a changed ``rollout.max_staleness`` is one line
each time it changes, in either direction (old -> new and what the new value means), nothing when
it stays; the warning of a first RL rollout sampled near uniform belongs to the run's first RL
rollout, not to each process: a run resumed past it does not repeat it."""
import pytest
import torch

from polyfsdp.trainer.algos.sample_ahead import staleness_change_line
from polyfsdp.trainer.train import main

JOB = ["trainer.sft_steps=0", "trainer.prompts_per_step=2", "algo.actor.group_size=2", "algo.actor.max_new_tokens=4",
       "data.eval_size=2", "eval.initial=false", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
       "trainer.eval_interval=0"]
FLAT = "warning: the first RL rollout was sampled at entropy"
STALENESS = "resume: rollout.max_staleness"


def _run(capfd, out, steps, *more):
    threads = torch.get_num_threads()
    try:
        code = main([*JOB, f"trainer.rl_steps={steps}", f"trainer.output_dir={out}", *more])
    finally:
        torch.set_num_threads(threads)
    said = capfd.readouterr()
    assert code == 0, said.err[-2000:]
    return said.out + said.err


@pytest.mark.parametrize("before,after", [(1, 2), (2, 0)])
def test_a_changed_max_staleness_is_one_line_at_each_change(tmp_path, capfd, before, after):
    out = tmp_path / "run"
    first = _run(capfd, out, 2, f"rollout.max_staleness={before}")
    assert STALENESS not in first
    changed = _run(capfd, out, 3, f"rollout.max_staleness={after}", "trainer.resume=auto")
    assert "resuming rl from" in changed
    lines = [line for line in changed.splitlines() if STALENESS in line]
    assert len(lines) == 1 and lines[0].startswith(f"{STALENESS} {before} -> {after}: "), lines
    kept = _run(capfd, out, 4, f"rollout.max_staleness={after}", "trainer.resume=auto")
    assert STALENESS not in kept  # unchanged since the last checkpoint: nothing to say
    again = _run(capfd, out, 5, f"rollout.max_staleness={before}", "trainer.resume=auto")
    assert [line for line in again.splitlines() if STALENESS in line][0].startswith(f"{STALENESS} {after} -> {before}: ")


def test_the_staleness_line_says_what_the_new_value_means_and_what_it_leaves_out():
    assert staleness_change_line(2, 2, 0) is None
    assert staleness_change_line(1, 2, 0) == ("resume: rollout.max_staleness 1 -> 2: step t trains on a batch sampled "
                                              "by the policy of step t - 2 (asynchronous; algo.rollout_correction "
                                              "corrects for it)")
    to_sync = staleness_change_line(2, 0, 2)
    assert to_sync.startswith("resume: rollout.max_staleness 2 -> 0: each step samples its batch with its own weights")
    assert to_sync.endswith("the checkpoint's 2 batch(es) sampled ahead are beyond it: sampled again with the current "
                            "weights")
    # a checkpoint that does not record its value: a line only when its queue is left out
    assert staleness_change_line(None, 1, 0) is None
    assert staleness_change_line(None, 0, 1).startswith("resume: rollout.max_staleness=0: each step samples")


def test_the_first_rollout_warning_is_not_repeated_by_a_resumed_run(tmp_path, capfd):
    out = tmp_path / "run"
    first = _run(capfd, out, 2)
    assert first.count(FLAT) == 1  # an untrained model samples near uniform
    resumed = _run(capfd, out, 4, "trainer.resume=auto")
    assert "resuming rl from" in resumed and FLAT not in resumed
