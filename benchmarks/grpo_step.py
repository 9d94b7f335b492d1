"""GRPO step speed: polyfsdp's ``rl_step`` against TRL's GRPOTrainer, side by side.

Same checkpoint (bench_task.py, built in code), same prompts, sampling settings, optimizer
settings and thread count; runs interleaved per seed (polyfsdp first on even seeds, TRL
first on odd ones). Prints per-step median time, tokens/s and the ratio polyfsdp/TRL per
seed, then the median ratio over seeds with its spread (min-max). TRL runs only when
``trl`` is installed (``pip install -e ".[bench]"``).

    python benchmarks/grpo_step.py                 # toy: 8 prompts x 8, 4 new tokens, fp32
    python benchmarks/grpo_step.py --case long     # 128..256 new tokens, lengths varying widely
    python benchmarks/grpo_step.py --quick         # smoke run (untrained model, 2 steps)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_task  # noqa: E402
import trl_grpo  # noqa: E402
from polyfsdp_grpo import PolyfsdpGRPO  # noqa: E402

CASES = {
    # name: (checkpoint mode, prompts per step, group size, max new tokens)
    "toy": ("toy", 8, 8, 4),
    "long": ("long", 2, 8, 256),
}


def run_case(args) -> dict:
    """Every seed's polyfsdp and TRL runs; returns per-seed medians and the ratio summary."""
    mode, prompts, group, new_tokens = CASES[args.case]
    prompts = args.prompts or prompts
    new_tokens = args.new_tokens or new_tokens
    path = bench_task.build_checkpoint(mode, warm_steps=0 if args.quick else args.warm_steps)
    with_trl = trl_grpo.available() and not args.no_trl
    rows = []
    for seed in range(args.seeds):
        batches = [bench_task.addition_examples(prompts, 10_000 * seed + i) for i in range(args.warmup + args.steps)]
        order = ["polyfsdp", "trl"] if seed % 2 == 0 else ["trl", "polyfsdp"]
        row = {"seed": seed}
        for who in order:
            torch.manual_seed(seed)
            if who == "polyfsdp":
                runner = PolyfsdpGRPO(path, group, new_tokens, optim_kwargs={"impl": args.adamw},
                                      engine_kwargs={"shard_single_rank": args.shard_single_rank},
                                      hf_generate=args.hf_generate)
                times, tokens, phases = runner.run(batches, seed, args.warmup)
                row["phases"] = {k: v / len(times) for k, v in phases.items()}
                del runner
            elif with_trl:
                times, tokens = trl_grpo.run_trl(path, batches, group, new_tokens, seed, args.warmup)
            else:
                continue
            row[who] = statistics.median(times)
            row[f"{who}_tok_s"] = sum(tokens) / sum(times)
        if with_trl:
            row["ratio"] = row["polyfsdp"] / row["trl"]
            row["tok_ratio"] = row["polyfsdp_tok_s"] / row["trl_tok_s"]
        rows.append(row)
    return {"rows": rows, "with_trl": with_trl, "path": path, "prompts": prompts, "group": group,
            "new_tokens": new_tokens}


def summary(values: list[float]) -> str:
    """``median [min-max]``."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def format_table(res: dict) -> str:
    """One line per seed and the median ratios over seeds."""
    lines = [f"{'seed':>4} {'polyfsdp ms':>12} {'tok/s':>8} {'TRL ms':>9} {'tok/s':>8} {'step ratio':>11} "
             f"{'tok/s ratio':>12}   polyfsdp phases ms (rollout / old log-probs / train)"]
    for r in res["rows"]:
        ph = r["phases"]
        trl = (f"{r['trl'] * 1e3:>9.1f} {r['trl_tok_s']:>8.0f} {r['ratio']:>11.2f} {r['tok_ratio']:>12.2f}"
               if res["with_trl"] else f"{'-':>9} {'-':>8} {'-':>11} {'-':>12}")
        lines.append(f"{r['seed']:>4} {r['polyfsdp'] * 1e3:>12.1f} {r['polyfsdp_tok_s']:>8.0f} {trl}   "
                     f"{ph.get('rollout', 0) * 1e3:.1f} / {ph.get('old_log_probs', 0) * 1e3:.1f} / "
                     f"{ph.get('train', 0) * 1e3:.1f}")
    if res["with_trl"]:
        lines.append(f"polyfsdp/TRL step time (median [min-max] over seeds): {summary([r['ratio'] for r in res['rows']])}"
                     f"; tokens/s polyfsdp/TRL: {summary([r['tok_ratio'] for r in res['rows']])}")
    else:
        lines.append("trl not installed (pip install -e '.[bench]'): polyfsdp only")
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Parse arguments, run the case, print the table; returns the raw results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="toy")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--warm-steps", type=int, default=30, help="SFT steps that warm up the checkpoint")
    parser.add_argument("--adamw", default="foreach", help="polyfsdp's OptimConfig.impl")
    parser.add_argument("--shard-single-rank", action="store_true",
                        help="polyfsdp keeps FSDP2 on one rank (EngineConfig.shard_single_rank; the old behaviour)")
    parser.add_argument("--hf-generate", action="store_true",
                        help="polyfsdp samples with HF generate instead of its decoding loop (the old way)")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 1 warm-up + 1 step, tiny batch")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.warmup = 1, 1, 1
        args.prompts, args.new_tokens = 2, min(args.new_tokens or 4, 4)
    torch.set_num_threads(args.threads)
    res = run_case(args)
    print(f"case={args.case} prompts={res['prompts']}x{res['group']} new_tokens={res['new_tokens']} fp32 "
          f"threads={args.threads} steps={args.steps} (+{args.warmup} warm-up) seeds={args.seeds} "
          f"checkpoint={res['path']} ({bench_task.num_parameters(res['path'])} parameters)")
    print(format_table(res))
    return res


if __name__ == "__main__":
    main()
