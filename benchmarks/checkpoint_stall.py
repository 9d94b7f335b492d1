"""How long a checkpoint stalls training, written synchronously and in the background
(``trainer.async_checkpoint``), on the engine of a preset (default ``qwen2-small``).

    python benchmarks/checkpoint_stall.py                                   # one rank
    torchrun --nproc_per_node 2 benchmarks/checkpoint_stall.py              # gloo on CPU

Per round (interleaved, ``--reps`` rounds): a plain SFT step (the step time), then a synchronous
save (its stall: the whole write), then a background save (its stall: the call's return, i.e.
copying the shards to host memory and writing the small files) followed at once by a step
(which runs beside the write) and the wait for the write. Medians of the slowest rank, seconds.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from polyfsdp.backends.distributed import all_gather_object, current_rank
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.engines.losses import SFTLoss


def _batch(vocab: int, rows: int, length: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length)
    mask[:, -1] = 0
    return TensorDict({"input_ids": ids, "attention_mask": torch.ones(rows, length, dtype=torch.long),
                       "response_mask": mask}, batch_size=[rows])


def _timed(work) -> float:
    t = time.perf_counter()
    work()
    return max(all_gather_object(time.perf_counter() - t))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2-small")
    parser.add_argument("--rows", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = FSDPEngine(ModelConfig(preset=args.preset), EngineConfig(pad_mode="left_right"),
                        OptimConfig(lr=1e-4)).initialize()
    vocab = engine.module.config.vocab_size
    loss = SFTLoss()
    step = iter(range(10**6))

    def train():
        engine.train_batch(_batch(vocab, args.rows, args.length, next(step) * 100 + current_rank()), loss)

    train()  # the optimizer state exists before the first save
    root = Path(all_gather_object(tempfile.mkdtemp(prefix="polyfsdp-stall-") if current_rank() == 0 else None)[0])
    rows = {"step_s": [], "sync_save_s": [], "async_stall_s": [], "step_beside_write_s": [], "async_wait_s": []}
    for rep in range(args.reps):
        rows["step_s"].append(_timed(train))
        rows["sync_save_s"].append(_timed(lambda: engine.save_checkpoint(str(root), step=2 * rep, keep=1)))
        pending = []
        rows["async_stall_s"].append(_timed(lambda: pending.append(
            engine.save_checkpoint(str(root), step=2 * rep + 1, keep=1, background=True))))
        rows["step_beside_write_s"].append(_timed(train))
        rows["async_wait_s"].append(_timed(pending[0].wait))
    result = {key: statistics.median(values) for key, values in rows.items()}
    if current_rank() == 0:
        size = sum(p.stat().st_size for p in next(root.glob("step_*")).iterdir()) / 2**20
        shutil.rmtree(root)
        print(f"{args.preset}, checkpoint {size:.1f} MB: step {result['step_s']:.3f} s; synchronous save stalls "
              f"{result['sync_save_s']:.3f} s; background save stalls {result['async_stall_s']:.3f} s, the step "
              f"beside its write takes {result['step_beside_write_s']:.3f} s, then waiting for the write "
              f"{result['async_wait_s']:.3f} s")
    return result


if __name__ == "__main__":
    main()
