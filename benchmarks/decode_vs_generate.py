"""Generation alone: polyfsdp's decoding loop (trainer/rollout/decode.py) against HF ``generate`` on the
same rows, model and seed, interleaved per round; the loop drawing from the process generator
(one multinomial over the batch) and with per-row seeds (trainer/rollout/row_sampler.py, what
the job samples with); also the loop with its levers off in turn
(transformers' per-step mask building instead of a ready mask; then also a plain growing
DynamicCache, which the ready mask needs), to show what each gives. Prints per variant the median time and its ratio to HF per round.

    python benchmarks/decode_vs_generate.py --rounds 7     # the long case's checkpoint and rows
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
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig  # noqa: E402
from polyfsdp.trainer.rollout import decode as decode_mod  # noqa: E402
from polyfsdp.trainer.data.chat import example_prompt_tokens  # noqa: E402
from polyfsdp.trainer.rollout.engines import SamplingParams  # noqa: E402
from polyfsdp.trainer.rollout.generate import _hf_generate, _left_padded  # noqa: E402
from polyfsdp.trainer.rollout.row_seeds import RowSeeds  # noqa: E402
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.tokenizers import load_tokenizer  # noqa: E402


def _loop(model, ids, mask, new_tokens, eos, prealloc: bool, ready_mask: bool, row_seeds=None):
    saved = decode_mod._preallocated_cache, decode_mod._ready_mask_ok
    if not prealloc:
        decode_mod._preallocated_cache = lambda m, capacity: decode_mod.DynamicCache(config=m.config)
    if not ready_mask:
        decode_mod._ready_mask_ok = lambda m, cache: False
    try:
        params = SamplingParams(new_tokens, stop_token_ids=(eos,), return_log_probs=True, pad_token_id=0)
        return decode_mod.decode(model, ids, mask, params, row_seeds)
    finally:
        decode_mod._preallocated_cache, decode_mod._ready_mask_ok = saved


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warm-steps", type=int, default=30, help="SFT steps that warm up the checkpoint")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = bench_task.build_checkpoint("long", warm_steps=args.warm_steps)
    tok = load_tokenizer(path)
    model = FSDPEngine(ModelConfig(path=path), EngineConfig()).initialize().module.eval()
    examples = [Example(prompt=p["prompt"], answer=p["answer"]) for p in bench_task.addition_examples(args.prompts, 0)]
    ids, mask = _left_padded([example_prompt_tokens(tok, e) for e in examples for _ in range(args.group)],
                             tok.pad_token_id)
    pad, eos, n = tok.pad_token_id, tok.eos_token_id, args.new_tokens
    seeds = RowSeeds(seed=0, step=0).rows(0, args.prompts, args.group)
    hf_params = SamplingParams(n, stop_token_ids=(eos,), return_log_probs=True, pad_token_id=pad)
    variants = {
        "HF generate": lambda: _hf_generate(model, ids, mask, hf_params, False),
        "loop": lambda: _loop(model, ids, mask, n, eos, True, True),
        "loop, per-row seeds (the job's)": lambda: _loop(model, ids, mask, n, eos, True, True, seeds),
        "loop, HF step masks": lambda: _loop(model, ids, mask, n, eos, True, False),
        "loop, growing cache, HF step masks": lambda: _loop(model, ids, mask, n, eos, False, False),
    }
    times = {name: [] for name in variants}
    lengths = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, fn in variants.items():
            torch.manual_seed(r)
            t = time.perf_counter()
            rows, _ = fn()
            if r:
                times[name].append(time.perf_counter() - t)
                lengths.setdefault(name, []).extend(len(x) for x in rows)
    base = times["HF generate"]
    print(f"{args.prompts}x{args.group} rows, up to {n} new tokens, threads={args.threads}, {args.rounds} rounds")
    for name, ts in times.items():
        per_round = [t / b for t, b in zip(ts, base)]
        print(f"{name:<36} median {statistics.median(ts) * 1e3:7.0f} ms   vs HF per round "
              f"{statistics.median(per_round):.2f} [{min(per_round):.2f}-{max(per_round):.2f}]   "
              f"mean completion {statistics.mean(lengths[name]):.1f} tokens, "
              f"{statistics.median(ts) * 1e3 / statistics.mean(lengths[name]):.1f} ms per mean token")
    return times


if __name__ == "__main__":
    main()
