"""Peak RSS per rank of a long-prompt ``polyfsdp-train`` RL job on 2 ranks (gloo, CPU):
``engine.ulysses_sp_size=2`` (one replica: the two ranks share each sequence, each runs half
of its positions) against sp=1 (two replicas, each rank its own prompt of the same length).

Each rank runs in a torchrun child with glibc's mmap threshold fixed (freed tensors return
their memory), imports what the job uses and warms the kernels, resets its peak RSS
(``/proc/self/clear_refs``), runs the job and reports the rise of the peak over that
baseline. Generation runs whole on every rank in both settings (SP splits the log-prob and
update passes), so the prompts are long and the completions short.

    python benchmarks/sp_job_memory.py                  # 4 layers, hidden 256, prompts of 3000 tokens
    python benchmarks/sp_job_memory.py --prompt-len 300 # a quick run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

from memory_table import peak_rss_rise
from sp_memory import alternate, print_table

MODEL = ["model=qwen2", "model.overrides.hidden_size=256", "model.overrides.intermediate_size=768",
         "model.overrides.num_hidden_layers=4", "model.overrides.num_attention_heads=8",
         "model.overrides.num_key_value_heads=2"]
JOB = ["trainer.sft_steps=0", "trainer.rl_steps=1", "algo.actor.group_size=2", "algo.actor.max_new_tokens=4",
       "algo.actor.kl_coef=0", "data=jsonl", "data.eval_size=2", "trainer.export=false",
       "trainer.checkpoint_interval=0", "trainer.plot=false", "trainer.progress=off", "trainer.cpu_threads=1"]


def write_data(path: str, prompt_len: int, records: int = 16) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(records):
            prompt = "".join(rng.choice("abcdefgh") for _ in range(prompt_len))
            f.write(json.dumps({"prompt": prompt, "answer": prompt[:4]}) + "\n")


def worker(out: str, overrides: list[str]) -> None:
    """One torchrun rank: warm up, reset the peak, run the job, write the rise to ``out.<rank>``."""
    import torch

    from polyfsdp.backends.topology import launch_env
    from polyfsdp.trainer.run import job  # noqa: F401  (imported before the baseline)
    from polyfsdp.trainer.train import main

    torch.set_num_threads(1)
    x = torch.randn(64, 64, requires_grad=True)
    (torch.nn.functional.silu(x @ x).softmax(-1).sum()).backward()
    code, rise = peak_rss_rise(lambda: main(overrides))
    if code != 0:
        raise SystemExit(f"job exited {code}")
    with open(f"{out}.{launch_env().rank}", "w") as f:
        f.write(str(rise))


def run_setting(sp: int, prompt_len: int, tmp: str) -> list[int]:
    """Per-rank peak rises of one 2-rank job (sp=1: 2 prompts, one per replica; sp=2: 1 prompt)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))
    from torchrun_launcher import free_port

    data = os.path.join(tmp, "long.jsonl")
    write_data(data, prompt_len)
    out = os.path.join(tmp, f"peak_sp{sp}")
    overrides = [*MODEL, *JOB, f"data.path={data}", f"+model.overrides.max_position_embeddings={prompt_len + 64}",
                 f"engine.ulysses_sp_size={sp}", f"trainer.prompts_per_step={2 // sp}",
                 f"trainer.output_dir={os.path.join(tmp, f'run_sp{sp}')}"]
    env = dict(os.environ, POLYFSDP_BACKEND="cpu", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), __file__, "--worker", out, json.dumps(overrides)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"sp={sp} job failed:\n{done.stderr[-3000:]}")
    return [int(open(f"{out}.{r}").read()) for r in range(2)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        peaks, best = alternate(lambda sp: run_setting(sp, args.prompt_len, tmp), args.repeats)
    print_table(f"RL job, prompts of {args.prompt_len} tokens, group 2, 4 new tokens, qwen2 4 layers hidden 256, "
                f"2 ranks (gloo, CPU)", "job peak RSS rise / rank",
                {1: "sp=1 (dp=2, 1 prompt / rank)", 2: "sp=2 (1 replica, 1 prompt)"}, best)
    return {"best": best, "peaks": peaks}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
