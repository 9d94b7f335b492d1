"""Benchmark: fused log-prob/entropy vs the naive full-logits path vs the bare-GEMM floor.

Every (path, phase) runs in its own subprocess so its peak memory (ru_maxrss minus the
baseline taken after the inputs exist) is clean. Objective for forward+backward:
``log_probs.sum() + entropy.sum()``. Prints one table with time and memory ratios.

    python benchmarks/fused_logprob.py              # (N, H, V) = (2048, 1024, 32768)
    python benchmarks/fused_logprob.py --large      # adds (4096, 896, 151936)
    python benchmarks/fused_logprob.py --quick      # tiny shapes, a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MIB = 2**20
PATHS = ("floor", "naive", "fused")
PHASES = ("fwd", "fwd+bwd")


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _naive(h, w, labels, temperature):
    """Full logits, as an unfused trainer computes them (verl's entropy_from_logits)."""
    import torch

    logits = (h @ w.t()).float() / temperature
    log_probs = logits.log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
    return log_probs, entropy


def _child(path: str, phase: str, n: int, hdim: int, v: int, repeats: int, threads: int,
           chunk_size: int | None, warmup: int = 1) -> dict:
    import torch

    from polyfsdp.engines.fused_logprob import fused_logprob_entropy

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    # In-place scaling: a temporary here would raise the ru_maxrss baseline and hide memory.
    h = torch.randn(n, hdim, generator=gen).mul_(0.5).requires_grad_(phase != "fwd" and path != "floor")
    w = torch.randn(v, hdim, generator=gen).div_(hdim**0.5).requires_grad_(phase != "fwd" and path != "floor")
    labels = torch.randint(0, v, (n,), generator=gen)
    grad_buf = torch.randn(n, v, generator=gen) if (path == "floor" and phase != "fwd") else None
    baseline = _rss_bytes()

    def run_once():
        if path == "floor":
            z = h @ w.t()
            if phase != "fwd":
                # The two gradient GEMMs of the backward, fed a ready-made (N, V) gradient.
                torch.mm(grad_buf, w)
                torch.mm(grad_buf.t(), h)
            return z
        if path == "naive":
            lp, ent = _naive(h, w, labels, 1.0)
        else:
            lp, ent = fused_logprob_entropy(h, w, labels, chunk_size=chunk_size)
        if phase != "fwd":
            (lp.sum() + ent.sum()).backward()
            h.grad = None
            w.grad = None
        return lp

    ctx = torch.no_grad() if phase == "fwd" else torch.enable_grad()
    times, cpu_times = [], []
    with ctx:
        for i in range(repeats + warmup):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = run_once()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            del out
            if i >= warmup:  # warm-up runs fill caches and the allocator
                times.append(elapsed)
                cpu_times.append(cpu)
    return {"min_s": min(times), "median_s": statistics.median(times), "cpu_s": min(cpu_times),
            "peak_extra_bytes": max(0, _rss_bytes() - baseline)}


def _measure(path, phase, shape, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, phase,
           *(str(x) for x in shape), "--repeats", str(args.repeats), "--threads", str(args.threads),
           "--warmup", str(args.warmup)]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    # PASSIVE: on a shared machine a thread waiting at a barrier sleeps instead of spinning,
    # so the CPU-time column measures the work, not the wait for a descheduled sibling.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc={done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(shape, results) -> str:
    floor = {ph: results.get(("floor", ph), {}) for ph in PHASES}
    naive_mem = {ph: results.get(("naive", ph), {}).get("peak_extra_bytes") for ph in PHASES}
    lines = [f"(N, H, V) = {shape}",
             f"{'path':<7} {'phase':<8} {'wall s':>8} {'x floor':>8} {'cpu s':>8} {'x floor':>8} "
             f"{'extra peak MiB':>15} {'/ naive':>8}"]
    for (path, phase), r in results.items():
        if "error" in r:
            lines.append(f"{path:<7} {phase:<8} ERROR {r['error']}")
            continue
        ref = floor[phase]
        ratio = f"{r['min_s'] / ref['min_s']:8.2f}" if ref.get("min_s") else f"{'-':>8}"
        cpu_ratio = f"{r['cpu_s'] / ref['cpu_s']:8.2f}" if ref.get("cpu_s") else f"{'-':>8}"
        nm = naive_mem.get(phase)
        mem_ratio = f"{r['peak_extra_bytes'] / nm:8.3f}" if nm and path != "floor" else f"{'-':>8}"
        lines.append(f"{path:<7} {phase:<8} {r['min_s']:8.3f} {ratio} {r['cpu_s']:8.3f} {cpu_ratio} "
                     f"{r['peak_extra_bytes'] / MIB:15.1f} {mem_ratio}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Parse arguments; as parent run every measurement in a child and print the tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    p.add_argument("--large", action="store_true", help="also run (4096, 896, 151936)")
    p.add_argument("--large-only", action="store_true", help="only the large shape")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (0 saves time at --large)")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--child", nargs=5, metavar=("PATH", "PHASE", "N", "H", "V"))
    args = p.parse_args(argv)
    if args.child:
        path, phase, n, hdim, v = args.child
        out = _child(path, phase, int(n), int(hdim), int(v), args.repeats or 1, args.threads, args.chunk_size,
                     args.warmup)
        print(json.dumps(out))
        return 0
    if args.quick:
        shapes, args.repeats = [(64, 32, 256)], args.repeats or 1
    else:
        shapes = [] if args.large_only else [(2048, 1024, 32768)]
        if args.large or args.large_only:
            shapes.append((4096, 896, 151936))
        args.repeats = args.repeats or 3
    paths = [x for x in args.paths.split(",") if x]
    phases = ("fwd+bwd",) if args.quick else PHASES  # quick: three children, a few seconds
    for shape in shapes:
        results = {}
        for path in paths:
            for phase in phases:
                results[(path, phase)] = _measure(path, phase, shape, args)
        print(_table(shape, results), flush=True)
    print(f"threads={args.threads} repeats={args.repeats} (min over repeats); floor = bare GEMMs "
          "(fwd: hidden @ weight.T; fwd+bwd: plus the two gradient GEMMs); cpu s = process CPU "
          "time (all threads), steadier than wall time on a shared machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
