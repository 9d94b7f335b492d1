"""Padding-free throughput: remove-padding on/off x fused log-prob on/off, side by side.

Tokens per second (real tokens only) of ``FSDPEngine.infer_batch`` and of a
forward+backward (objective: sum of log-probs + entropy) on one batch whose lengths
average 50% of the maximum (evenly spread from 1 to L). Modes are timed round-robin
within each repetition so drift hits all of them alike. On a shared machine other
processes steal time in bursts, so each mode reports its best (least disturbed) wall time
and, as a cross-check, its best process CPU time; ratios are to the padded, unfused baseline.

    python benchmarks/padding_free.py            # Qwen2-style 4 layers, hidden 256, B=8, L=1024
    python benchmarks/padding_free.py --quick    # tiny smoke run
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
from tensordict import TensorDict

from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.flat_batch import batch_to_flat
from polyfsdp.engines.jagged import make_jagged

MODES = [(False, False), (False, True), (True, False), (True, True)]
TARGET = 1.6


def mode_name(rmpad: bool, fused: bool) -> str:
    """Human-readable mode label."""
    return f"{'rmpad ' if rmpad else 'padded'} {'fused  ' if fused else 'unfused'}"


def make_batch(batch_size: int, max_len: int, vocab: int, seed: int = 0) -> TensorDict:
    """A no_padding batch with lengths evenly spread over [1, max_len] (mean ~50% fill)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(1, max_len, batch_size).round().long()
    values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return TensorDict({"input_ids": make_jagged(values, offsets)}, batch_size=[batch_size])


def _time(fn) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def measure(preset: str, batch_size: int, max_len: int, reps: int, warmup: int, attn: str | None) -> dict:
    """Best wall and CPU seconds per mode for infer and forward+backward, plus the token count."""
    engine = FSDPEngine(ModelConfig(preset=preset, attn_implementation=attn), EngineConfig()).initialize()
    vocab = engine.module.config.vocab_size
    batch = make_batch(batch_size, max_len, vocab)
    tokens = int(batch["input_ids"].values().numel())
    results = {mode: {"infer": [], "train": [], "infer_cpu": [], "train_cpu": []} for mode in MODES}

    def train_step():
        flat = batch_to_flat(batch, "no_padding", keys=())
        with engine.train_mode():
            lp, ent = engine.forward_flat(flat, return_entropy=True)
            (lp.sum() + ent.sum()).backward()
        engine.optimizer.zero_grad(set_to_none=True)

    for rep in range(warmup + reps):
        for rmpad, fused in MODES:
            engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused)
            t_infer = _time(lambda: engine.infer_batch(batch))
            t_train = _time(train_step)
            if rep >= warmup:
                for phase, (wall, cpu) in (("infer", t_infer), ("train", t_train)):
                    results[(rmpad, fused)][phase].append(wall)
                    results[(rmpad, fused)][f"{phase}_cpu"].append(cpu)
    return {"tokens": tokens, "fill": tokens / (batch_size * max_len),
            "best": {m: {k: min(v) for k, v in r.items()} for m, r in results.items()}}


def format_table(res: dict) -> str:
    """One table: tokens/s (best wall time) and the ratio to the padded, unfused baseline,
    by wall time and by CPU time, per phase."""
    tokens, best = res["tokens"], res["best"]
    base = best[(False, False)]
    lines = [f"{'mode':<16} {'infer tok/s':>12} {'x padded':>9} {'(cpu)':>7}   "
             f"{'fwd+bwd tok/s':>14} {'x padded':>9} {'(cpu)':>7}"]
    for mode in MODES:
        m = best[mode]
        cells = []
        for phase, width in (("infer", 12), ("train", 14)):
            cells.append(f"{tokens / m[phase]:>{width}.0f} {base[phase] / m[phase]:>8.2f}x "
                         f"{base[phase + '_cpu'] / m[phase + '_cpu']:>6.2f}x")
        lines.append(f"{mode_name(*mode):<16} {cells[0]}   {cells[1]}")
    rm = best[(True, False)]
    lines.append(f"remove-padding speed-up (unfused) at {res['fill']:.0%} fill: infer "
                 f"{base['infer'] / rm['infer']:.2f}x, fwd+bwd {base['train'] / rm['train']:.2f}x "
                 f"(target >= {TARGET}x)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Parse arguments, run the measurement, print the table; returns the raw results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and batch, one repetition (smoke test)")
    parser.add_argument("--preset", default="qwen2-small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attn", default=None, help="attn_implementation (default: the backend's choice)")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.batch_size, args.max_len, args.reps, args.warmup = "qwen2-tiny", 4, 32, 1, 0
    res = measure(args.preset, args.batch_size, args.max_len, args.reps, args.warmup, args.attn)
    print(f"preset={args.preset} B={args.batch_size} L={args.max_len} tokens={res['tokens']} "
          f"threads={torch.get_num_threads()} reps={args.reps} (best of reps)")
    print(format_table(res))
    return res


if __name__ == "__main__":
    main()
