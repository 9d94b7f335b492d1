"""Rollout engines side by side (``rollout.engine``: builtin, hf, vllm) on one rank, and the
vLLM weight sync's time against the parameter count.

Every engine decodes the same prompts to the full ``--new-tokens`` (the stop token is one the
model never emits), sampling at temperature 1; rounds are interleaved (the order rotates) and
the medians of tokens/s are printed. The sync is timed after a weight change, for
``qwen2-small`` resized to several widths (check_sync off: the sync alone).

    python benchmarks/rollout_engines.py --rows 64 --new-tokens 256        # needs vLLM
    python benchmarks/rollout_engines.py --engines builtin hf --quick       # no vLLM needed
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.engines.presets import preset_config
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.rollout.build import build_rollout_engine
from polyfsdp.trainer.rollout.engines import SamplingParams


def _policy(hidden: int, layers: int, seed: int = 0) -> FSDPEngine:
    """qwen2-small (heads of 32) at ``hidden`` width and ``layers`` layers, from a local checkpoint."""
    config = preset_config("qwen2-small", hidden_size=hidden, intermediate_size=3 * hidden,
                           num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 128),
                           num_hidden_layers=layers)
    directory = tempfile.mkdtemp(prefix="polyfsdp-bench-")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return FSDPEngine(ModelConfig(path=directory), EngineConfig()).initialize()


def compare_engines(names, rows: int, new_tokens: int, rounds: int) -> dict[str, float]:
    """Median tokens/s of each engine over interleaved rounds."""
    policy = _policy(256, 4)
    vocab = policy.module.config.vocab_size
    # Sampled, stopping at a token never sampled (every row runs to the full length).
    params = SamplingParams(new_tokens, stop_token_ids=(vocab - 1,), pad_token_id=0)
    prompts = [[1 + (7 * r + k) % (vocab - 2) for k in range(16)] for r in range(rows)]
    engines = {name: build_rollout_engine(RolloutSection(engine=name, vllm={"max_num_seqs": max(rows, 1)}),
                                          get_backend("cpu")) for name in names}
    speeds = {name: [] for name in names}
    try:
        for name, engine in engines.items():  # warm-up (vLLM starts at its first sync)
            engine.update_weights(policy)
            engine.generate(prompts[:2], replace(params, max_new_tokens=2))
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                torch.manual_seed(r)
                t0 = time.perf_counter()
                out = engines[name].generate(prompts, params).token_ids
                speeds[name].append(sum(len(o) for o in out) / (time.perf_counter() - t0))
    finally:
        for engine in engines.values():
            engine.close()
    return {name: statistics.median(v) for name, v in speeds.items()}


def sync_times(widths, layers: int, repeats: int) -> list[tuple[int, float]]:
    """``(parameters, median seconds)`` of a vLLM weight sync per model width."""
    results = []
    for hidden in widths:
        policy = _policy(hidden, layers)
        engine = build_rollout_engine(RolloutSection(engine="vllm", check_sync=False), get_backend("cpu"))
        try:
            engine.update_weights(policy)  # start
            times = []
            for _ in range(repeats):
                policy.weights_version += 1  # as an optimizer step does
                engine.update_weights(policy)
                times.append(engine.last_sync_s)
        finally:
            engine.close()
        results.append((sum(p.numel() for p in policy.module.parameters()), statistics.median(times)))
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["builtin", "hf", "vllm"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sync-widths", type=int, nargs="*", default=[256, 512, 1024],
                        help="model widths for the sync table (needs vLLM; none: skip it)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.new_tokens, args.rounds, args.sync_widths = 2, 4, 1, args.sync_widths[:1]
    torch.set_num_threads(args.threads)
    speeds = compare_engines(args.engines, args.rows, args.new_tokens, args.rounds)
    print(f"| engine | tokens/s ({args.rows} rows x {args.new_tokens} tokens, median of {args.rounds}) |")
    print("| --- | --- |")
    for name, value in speeds.items():
        print(f"| {name} | {value:.0f} |")
    syncs = sync_times(args.sync_widths, 4, 3) if "vllm" in args.engines and args.sync_widths else []
    if syncs:
        print("| parameters | sync s (median of 3) |")
        print("| --- | --- |")
        for count, seconds in syncs:
            print(f"| {count / 1e6:.1f}M | {seconds:.3f} |")
    return {"tokens_per_s": speeds, "sync_s": syncs}


if __name__ == "__main__":
    main()
