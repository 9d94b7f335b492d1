"""Checkpoint verification on load: what each rank hashes, before (every rank hashed every file,
``verify_checkpoint``) and now (each rank the files it reads, rank 0 also the rest, in
``load_checkpoint``), for checkpoints of growing size.

    torchrun --nproc_per_node 2 benchmarks/checkpoint_verify.py          # gloo on CPU
    python benchmarks/checkpoint_verify.py --sizes-mb 2                   # one rank, smoke run

A stack of linear layers (``--sizes-mb`` of fp32 parameters each; with AdamW's two moments the
checkpoint is about three times that) is sharded over the ranks, stepped once and saved; then
the load is timed with every SHA-256 of the checkpoint's files accounted per rank. Times are the
slowest rank's wall seconds of hashing (medians of ``--reps``); bytes are per rank.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

from polyfsdp.backends import get_backend, init_distributed
from polyfsdp.backends.distributed import all_gather_object, barrier, current_rank, current_world_size
from polyfsdp.engines import checkpoint
from polyfsdp.engines.checkpoint import files as checkpoint_files

WIDTH = 512  # one layer: WIDTH x WIDTH fp32 = 1 MiB


def _model(mesh, megabytes: int):
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(megabytes)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


class _HashLog:
    """Wraps ``checkpoint_files._sha256``: seconds and bytes hashed on this rank."""

    def __init__(self):
        self.seconds, self.bytes, self._real = 0.0, 0, checkpoint_files._sha256

    def __enter__(self):
        def timed(path, start=0, length=None):
            t = time.perf_counter()
            digest = self._real(path, start, length)
            self.seconds += time.perf_counter() - t
            self.bytes += min(Path(path).stat().st_size - start, float("inf") if length is None else length)
            return digest
        checkpoint_files._sha256 = timed
        return self

    def __exit__(self, *exc):
        checkpoint_files._sha256 = self._real


def _slowest(seconds: float, hashed: int) -> tuple[float, int, int]:
    gathered = all_gather_object((seconds, hashed))
    return max(s for s, _ in gathered), max(b for _, b in gathered), sum(b for _, b in gathered)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    mesh = init_distributed(get_backend("cpu"))
    rows = []
    for megabytes in args.sizes_mb:
        model, optimizer = _model(mesh, megabytes)
        root = Path(all_gather_object(tempfile.mkdtemp(prefix="polyfsdp-verify-") if current_rank() == 0 else None)[0])
        path = checkpoint.save_checkpoint(root, 1, model=model, optimizer=optimizer)
        size = sum(p.stat().st_size for p in path.iterdir())
        before, after = [], []
        for _ in range(args.reps):  # interleaved: the host's load hits both alike
            with _HashLog() as log:  # before: every rank verified every file
                checkpoint_files.verify_checkpoint(path)
            before.append(_slowest(log.seconds, log.bytes))
            with _HashLog() as log:
                checkpoint.load_checkpoint(path, model=model, optimizer=optimizer)
            after.append(_slowest(log.seconds, log.bytes))
        row = {"checkpoint_mb": size / 2**20, "ranks": current_world_size(),
               "before_s": statistics.median(s for s, _, _ in before), "before_rank_mb": before[0][1] / 2**20,
               "before_total_mb": before[0][2] / 2**20,
               "after_s": statistics.median(s for s, _, _ in after), "after_rank_mb": after[0][1] / 2**20,
               "after_total_mb": after[0][2] / 2**20}
        rows.append(row)
        barrier()
        if current_rank() == 0:
            shutil.rmtree(root)
    if current_rank() == 0:
        print("| checkpoint MB | ranks | before: s (slowest rank) | MB hashed per rank (max) / all ranks | "
              "now: s (slowest rank) | MB hashed per rank (max) / all ranks |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['checkpoint_mb']:.1f} | {r['ranks']} | {r['before_s']:.3f} | {r['before_rank_mb']:.1f} / "
                  f"{r['before_total_mb']:.1f} | {r['after_s']:.3f} | {r['after_rank_mb']:.1f} / "
                  f"{r['after_total_mb']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
