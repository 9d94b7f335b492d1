"""polyfsdp-train with rollout.engine=vllm end to end (SFT, then GRPO, evaluations, export),
against the same job sampled by our decoding loop: the greedy evaluations before GRPO agree
(so vLLM followed the weights across phases: SFT's engine, then GRPO's), and every GRPO
step's sampled log-probs equal the trainer's (the mismatch metric, on by default with vLLM); a
run killed and resumed with vLLM sampling continues the uninterrupted run's curve (slow: run with
``pytest -m extended``)."""
import signal
import subprocess
import sys

import pytest
import torch

from polyfsdp.trainer.tracking.metrics import TIMING_KEYS, read_metrics
from polyfsdp.trainer.train import main
from tests.helpers.kill_at_checkpoint import kill_after_checkpoint
from tests.helpers.vllm_cases import require_vllm

JOB = ["trainer.sft_steps=2", "trainer.rl_steps=3", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
       "data.eval_size=8", "trainer.progress=off", "trainer.plot=false", "algo.actor.group_size=4",
       "algo.actor.temperature=0.8", "algo.actor.optim.lr=1e-2",
       # vLLM's CPU attention needs head size >= 32.
       "model.overrides.hidden_size=64", "model.overrides.intermediate_size=128",
       "model.overrides.num_attention_heads=2", "model.overrides.num_key_value_heads=1"]


def _run(out, *overrides):
    threads = torch.get_num_threads()
    try:
        assert main([*JOB, f"trainer.output_dir={out}", *overrides]) == 0
    finally:
        torch.set_num_threads(threads)
    return read_metrics(str(out / "metrics.jsonl"))


def test_vllm_job_agrees_with_the_builtin_loop(tmp_path):
    require_vllm()
    ours = _run(tmp_path / "builtin", "rollout.engine=builtin")
    theirs = _run(tmp_path / "vllm", "rollout.engine=vllm")
    evals = lambda records: {r["tag"]: r["reward"] for r in records if r["phase"] == "eval"}  # noqa: E731
    assert evals(theirs)["initial"] == evals(ours)["initial"]
    assert evals(theirs)["after_sft"] == evals(ours)["after_sft"]
    grpo = [r for r in theirs if r["phase"] == "rl"]
    assert len(grpo) == 3
    assert all(r["rollout_mismatch_abs_max"] < 1e-5 for r in grpo), [r["rollout_mismatch_abs_max"] for r in grpo]
    assert (tmp_path / "vllm" / "final" / "config.json").is_file()



@pytest.mark.extended
def test_kill_and_resume_with_vllm_sampling_continues_the_same_curve(tmp_path):
    """SIGKILL after RL step 2's checkpoint, then resume=auto: vLLM starts afresh from the
    checkpoint's weights and, seeded per request, draws what the uninterrupted run drew. Marked
    slow, outside CI's gate: at 28576c2 one pass in two differed at step 4 in the last bits of kl
    and the mismatch metrics (cause not found); at 2561479 six passes in six were bitwise equal
    (four with a core kept busy; a seventh as this test), so it runs by hand until more passes settle it."""
    require_vllm()
    job = ["rollout.engine=vllm", "trainer.rl_steps=4", "trainer.checkpoint_interval=2", "trainer.export=false"]
    reference = _run(tmp_path / "full", *job)
    out = tmp_path / "killed"
    proc, _ = kill_after_checkpoint([*JOB, *job, f"trainer.output_dir={out}", "trainer.progress=lines"])
    assert proc.returncode == -signal.SIGKILL
    resumed = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *JOB, *job, f"trainer.output_dir={out}",
                              "trainer.resume=auto"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming rl from" in resumed.stdout
    comparable = lambda records: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]  # noqa: E731
    assert comparable(read_metrics(str(out / "metrics.jsonl"))) == comparable(reference)
