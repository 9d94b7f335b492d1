"""One decoding step's token draw: per-row generators with Gumbel-max (RowSampler,
trainer/rollout/row_sampler.py, what sampling uses) against one ``torch.multinomial`` over the
batch's softmax (the process-generator draw it replaced), for a char-sized and BPE-sized
vocabularies; interleaved per round, prints per shape the median times and their ratio.

    python benchmarks/row_sampling.py --rounds 5 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from polyfsdp.trainer.rollout.row_sampler import RowSampler


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[64, 32768, 151936])
    parser.add_argument("--repeats", type=int, default=None,
                        help="draws timed per round (default: about 2e6 logits' worth, at least 3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ratios_by_shape = {}
    print(f"{'vocab':>7} {'rows':>5} {'multinomial ms':>15} {'row generators ms':>18} {'ratio':>6} {'range':>12}")
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.randn(rows, vocab)
            sampler = RowSampler(list(range(rows)), "cpu")
            order = list(range(rows))
            repeats = args.repeats or max(3, int(2e6 / (rows * vocab)))
            batch, per_row = [], []
            for r in range(args.rounds):
                draws = [lambda: torch.multinomial(torch.softmax(logits, -1), 1)[:, 0],
                         lambda: sampler.draw(logits, order)]
                first, second = (0, 1) if r % 2 == 0 else (1, 0)
                took = {i: _median_seconds(draws[i], repeats) for i in (first, second)}
                batch.append(took[0])
                per_row.append(took[1])
            ratios = [p / b for p, b in zip(per_row, batch)]
            ratios_by_shape[(vocab, rows)] = ratios
            print(f"{vocab:7d} {rows:5d} {statistics.median(batch) * 1e3:15.3f} {statistics.median(per_row) * 1e3:18.3f}"
                  f" {statistics.median(ratios):6.2f} {min(ratios):5.2f}-{max(ratios):.2f}", flush=True)
    return ratios_by_shape


if __name__ == "__main__":
    main()
