"""Measured peak memory of whole ``polyfsdp-train`` jobs on CPU beside ``--estimate``'s peak
(trainer/run/estimate.py).

Each job runs in a fresh child process with glibc's mmap threshold fixed (every large tensor
is its own mapping and freeing it returns the memory, so RSS follows the live tensors). The
child first imports everything the job uses and runs a tiny forward/backward, so the python,
torch and transformers baseline (libraries, thread pools, kernel caches) is in the RSS before
the job; it then resets the peak RSS (``/proc/self/clear_refs``), runs the job and reports the
rise of the peak over that baseline, beside the estimate's live peak (``peak(live=True)``: the
fixed mmap threshold leaves no heap slack, and the baseline is not in the rise). Usage: ``python benchmarks/job_memory.py [sft grpo ppo 'lora grpo']``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from memory_table import peak_rss_rise

MIB = 2 ** 20
# A model large enough that the job's memory dominates the allocator's noise, small enough
# for a busy 2-core machine: qwen2 with hidden 512, 4 layers; the built-in reverse task.
MODEL = ["model.overrides.hidden_size=512", "model.overrides.intermediate_size=1536",
         "model.overrides.num_hidden_layers=4", "model.overrides.num_attention_heads=8",
         "model.overrides.num_key_value_heads=2"]
# Two steps: AdamW's state appears at the first optimizer step, so from the second step on the
# job holds what every later step holds (the estimate counts it throughout).
QUICK = ["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=64",
         "trainer.prompts_per_step=16", "data.eval_size=4", "trainer.export=false",
         "trainer.checkpoint_interval=0", "trainer.plot=false", "trainer.progress=off", "trainer.eval_interval=0"]
RL = ["trainer.sft_steps=0", "algo.actor.group_size=8", "algo.actor.max_new_tokens=16"]
JOBS = {  # name -> overrides (on top of MODEL and QUICK)
    "sft": ["algo=sft", "trainer.sft_batch_size=256"],
    "grpo": RL,
    "ppo": ["algo=ppo", *RL],
    "lora grpo": ["model.lora.rank=16", *RL],
}


def child(overrides: list[str]) -> dict:
    """Run one job in this process: the measured peak rise and the estimate's peak (bytes)."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the baseline)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    from polyfsdp.trainer.run import job  # noqa: F401
    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.run.estimate import estimate_job
    from polyfsdp.trainer.train import main

    if "model.lora.rank=16" in " ".join(overrides):
        import peft  # noqa: F401
    torch.set_num_threads(1)
    x = torch.randn(64, 64, requires_grad=True)
    (torch.nn.functional.silu(x @ x).softmax(-1).sum()).backward()  # warm the kernels
    estimate = estimate_job(load_config(overrides), world_size=1)
    peak, where = estimate.peak(live=True)
    code, rise = peak_rss_rise(lambda: main(overrides))
    if code != 0:
        raise RuntimeError(f"job exited {code}")
    return {"measured": rise, "estimated": peak, "at": where}


def run_job(name: str, output_dir: str) -> dict:
    """Run job ``name`` (JOBS) in a fresh child process (see the module docstring)."""
    overrides = [*MODEL, *QUICK, *JOBS[name], f"trainer.output_dir={output_dir}", "trainer.cpu_threads=1"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(overrides)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"job memory child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    print(f"{'job':<12} {'measured MiB':>13} {'estimated MiB':>14} {'est/meas':>9}  peak at")
    for name in sys.argv[1:] or JOBS:
        with tempfile.TemporaryDirectory() as tmp:
            out = run_job(name, os.path.join(tmp, "run"))
        print(f"{name:<12} {out['measured'] / MIB:>13.1f} {out['estimated'] / MIB:>14.1f} "
              f"{out['estimated'] / out['measured']:>9.2f}  {out['at']}")


if __name__ == "__main__":
    main()
