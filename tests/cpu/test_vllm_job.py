"""polyfsdp-train with rollout.engine=vllm end to end (SFT, then GRPO, evaluations, export),
against the same job sampled by our decoding loop: the greedy evaluations before GRPO agree
(so vLLM followed the weights across phases: SFT's engine, then GRPO's), and every GRPO
step's sampled log-probs equal the trainer's (the mismatch metric, on by default with vLLM)."""
import torch

from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main
from vllm_cases import require_vllm

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

