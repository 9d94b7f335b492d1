"""Where a polyfsdp GRPO step spends its time: torch.profiler's CPU op table over a few
steps of the toy task (benchmarks/bench_task.py), with the phases (rollout, old log-probs,
train) marked as record_function ranges, and a Python-level cProfile of the same steps.

    python benchmarks/profile_step.py                     # toy task, 8 prompts x 8, 4 new tokens
    python benchmarks/profile_step.py --steps 3 --rows 40 --python
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_task  # noqa: E402
from polyfsdp_grpo import PhaseTimer, PolyfsdpGRPO, timed_phases  # noqa: E402


class RangeTimer(PhaseTimer):
    """A PhaseTimer that also marks each phase as a profiler range."""

    def wrap(self, name, fn):
        timed = super().wrap(name, fn)

        def marked(*args, **kwargs):
            with torch.profiler.record_function(f"## {name}"):
                return timed(*args, **kwargs)
        return marked


def main(argv=None) -> dict:
    """Profile ``--steps`` GRPO steps after ``--warmup``; prints the op tables; returns phase times."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--python", action="store_true", help="also print a cProfile table (cumulative)")
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 1 step, untrained model (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.prompts, args.group = 1, 1, 2, 2
    torch.set_num_threads(args.threads)
    path = bench_task.build_checkpoint("toy", warm_steps=0 if args.quick else 30)
    runner = PolyfsdpGRPO(path, args.group, args.new_tokens)
    batches = [bench_task.addition_examples(args.prompts, 1000 + i) for i in range(args.warmup + args.steps)]
    for i in range(args.warmup):
        runner.step(batches[i], i)
    timer = RangeTimer()
    py = cProfile.Profile() if args.python else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with timed_phases(runner.engine, runner.driver, timer):
            if py:
                py.enable()
            for i in range(args.warmup, args.warmup + args.steps):
                with torch.profiler.record_function("## step"):
                    runner.step(batches[i], i)
            if py:
                py.disable()
    per_step = {k: v / args.steps * 1e3 for k, v in timer.times.items()}
    print(f"threads={args.threads} prompts={args.prompts}x{args.group} new_tokens={args.new_tokens} "
          f"steps={args.steps} (profiled; times include profiler overhead)")
    print("phase ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items()))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if py:
        out = io.StringIO()
        pstats.Stats(py, stream=out).sort_stats("cumulative").print_stats(args.rows)
        print(out.getvalue())
    return per_step


if __name__ == "__main__":
    main()
