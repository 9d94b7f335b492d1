"""Generation on several ranks: per-layer gathering at every decoding step (with
``synced_gpus``) against gathering once per rollout (``rollout.unshard``), interleaved.

    torchrun --nproc_per_node 2 benchmarks/generate_ranks.py          # gloo on CPU
    python benchmarks/generate_ranks.py --quick                       # one rank, smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_task  # noqa: E402
from polyfsdp.backends.distributed import all_reduce_max, current_rank, current_world_size  # noqa: E402
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig  # noqa: E402
from polyfsdp.trainer.rollout.engines import SamplingParams  # noqa: E402
from polyfsdp.trainer.rollout.generate import generate  # noqa: E402
from polyfsdp.trainer.data.tokenizers import load_tokenizer  # noqa: E402


def main(argv=None) -> dict:
    """Time ``--reps`` rollouts per setting (slowest rank counts); prints the speed-up."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("toy", "long"), default="long")
    parser.add_argument("--rows", type=int, default=16, help="prompts per rank")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.new_tokens, args.reps = 2, 4, 1
    torch.set_num_threads(args.threads)
    path = bench_task.build_checkpoint(args.case, warm_steps=0 if args.quick else 30)
    tok = load_tokenizer(path)
    engine = FSDPEngine(ModelConfig(path=path), EngineConfig()).initialize()
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.reps + 1):
        # Different prompts per rank (and so different completion lengths), as in training.
        prompts = [tok.encode(e["prompt"]) for e in bench_task.addition_examples(args.rows, 100 * rep + current_rank())]
        for unshard in ((False, True) if rep % 2 == 0 else (True, False)):
            torch.manual_seed(rep)
            t = time.perf_counter()
            generate(engine, prompts, SamplingParams.for_tokenizer(tok, args.new_tokens), unshard=unshard)
            dt = all_reduce_max([time.perf_counter() - t], engine.device)[0]
            if rep > 0 or args.reps == 1:
                times[unshard].append(dt)
    per = {k: statistics.median(v) for k, v in times.items()}
    if current_rank() == 0:
        print(f"ranks={current_world_size()} case={args.case} rows/rank={args.rows} new_tokens={args.new_tokens} "
              f"threads={args.threads} reps={args.reps}")
        print(f"per-layer gather every step: {per[False] * 1e3:8.1f} ms   gather once: {per[True] * 1e3:8.1f} ms   "
              f"speed-up {per[False] / per[True]:.2f}x")
    return per


if __name__ == "__main__":
    main()
