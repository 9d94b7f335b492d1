"""Peak activation memory per rank with Ulysses sequence parallelism: sp=2 vs sp=1, side by side.

Two ranks (gloo, CPU) run one ``forward_backward`` (SFT loss over every token, fused head,
packed rows) on long sequences. sp=1: each rank holds its own sequence (dp=2). sp=2: the two
ranks share one sequence, each running half of its positions. Reported per rank: the peak
resident memory (RSS, sampled every 2 ms) during the step minus the RSS just before it, i.e.
the step's activations and gradients. Each setting runs in fresh processes (twice,
alternating; the smaller peak counts) so one run's freed memory does not hide the next's.

    python benchmarks/sp_memory.py              # qwen2-small (4 layers, hidden 256, 8 heads), 4096 tokens
    python benchmarks/sp_memory.py --quick      # tiny smoke run
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS in a thread; ``peak`` is the largest value seen."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak, self._stop = interval_s, _rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def worker(preset: str, length: int, sp: int, out: str) -> None:
    """One torchrun rank: one forward_backward, write ``step_peak_bytes`` to ``out.<rank>``."""
    import gc

    import torch
    from tensordict import TensorDict

    from polyfsdp.backends import destroy_distributed
    from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, SFTLoss, make_jagged

    config = EngineConfig(use_remove_padding=True, use_fused_kernels=True, ulysses_sp_size=sp)
    engine = FSDPEngine(ModelConfig(preset=preset), config).initialize()
    rank = engine.topology.rank
    vocab = engine.module.config.vocab_size
    # sp=2: the group shares sequence 0; sp=1: each rank its own.
    g = torch.Generator().manual_seed(engine.topology.replica)
    ids = torch.randint(0, vocab, (length,), generator=g)
    offsets = torch.tensor([0, length])
    batch = TensorDict({"input_ids": make_jagged(ids, offsets),
                        "response_mask": make_jagged(torch.ones(length), offsets)}, batch_size=[1])
    gc.collect()
    before = _rss_bytes()
    with PeakRSS() as peak:
        engine.forward_backward(batch, SFTLoss())
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(peak.peak - before))
    destroy_distributed()


def run_setting(preset: str, length: int, sp: int) -> list[int]:
    """Per-rank step peaks of one fresh 2-process run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peak")
        env = dict(os.environ, POLYFSDP_BACKEND="cpu", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))
        from torchrun_launcher import free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), __file__, "--worker", preset, str(length), str(sp), out]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"sp={sp} run failed:\n{result.stderr[-3000:]}")
        return [int(open(f"{out}.{r}").read()) for r in range(2)]


def alternate(run, repeats: int) -> tuple[dict[int, list[int]], dict[int, int]]:
    """``run(sp)`` (per-rank peaks of one fresh run) for sp=1 and sp=2, alternating, ``repeats``
    times: each run's largest rank peak, and per setting the smallest of those."""
    peaks: dict[int, list[int]] = {1: [], 2: []}
    for _ in range(repeats):
        for sp in (1, 2):
            peaks[sp].append(max(run(sp)))
    return peaks, {sp: min(values) for sp, values in peaks.items()}


def print_table(title: str, column: str, names: dict[int, str], best: dict[int, int]) -> None:
    """The two settings' peaks per rank and their ratio to sp=1."""
    mib = 1024 * 1024
    width = max(len(n) for n in names.values()) + 2
    print(title)
    print(f"{'setting':<{width}}{column:>{len(column) + 4}}{'ratio to sp=1':>16}")
    for sp in (1, 2):
        print(f"{names[sp]:<{width}}{best[sp] / mib:>{len(column)}.1f} MiB{best[sp] / best[1]:>16.2f}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, short sequence (smoke run)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    preset, length = ("qwen2-tiny", 256) if args.quick else ("qwen2-small", args.length)
    peaks, best = alternate(lambda sp: run_setting(preset, length, sp), args.repeats)
    print_table(f"{preset}, one sequence of {length} tokens per SP group, fused head, packed rows, 2 ranks "
                f"(gloo, CPU)", "step peak RSS / rank", {1: "sp=1 (dp=2)", 2: "sp=2 (one SP group)"}, best)
    return {"best": best, "peaks": peaks}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
