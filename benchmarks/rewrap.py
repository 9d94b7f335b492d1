"""Dense -> jagged rewrap, side by side: boolean mask (verl PR 6846), narrow/unbind/cat,
torch's native padded->jagged op, polyfsdp's ``dense_to_flat``, and the floor (one
contiguous copy of the total_nnz rows). Every method starts from the padded tensor and
host-side lengths and returns values + offsets. Times are the minimum over interleaved
rounds, in ms; the ratio is to the floor.

Run: ``python benchmarks/rewrap.py`` (about a minute) or ``--quick`` (seconds).
"""
from __future__ import annotations

import argparse
import time

import torch

from polyfsdp.backends import get_backend
from polyfsdp.engines.jagged import dense_to_flat

FULL_SHAPES = [(8, 8192, ()), (64, 4096, ()), (512, 1024, ()), (8, 2048, (896,)), (64, 512, (896,))]
QUICK_SHAPES = [(8, 256, ()), (4, 64, (32,))]
METHODS = ("mask", "narrow+cat", "aten", "ours", "floor")


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offs = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offs[1:])
    return offs


def make_methods(dense: torch.Tensor, lengths: torch.Tensor) -> dict:
    """One closure per method, each returning (values, offsets) for this batch."""
    dev = dense.device
    L = dense.shape[1]
    total = int(lengths.sum())
    flat = dense.reshape(-1, *dense.shape[2:])

    def mask():
        lens = lengths.to(dev, non_blocking=True)
        keep = torch.arange(L, device=dev)[None, :] < lens[:, None]
        return dense[keep], _offsets(lengths).to(dev, non_blocking=True)

    def narrow_cat():
        rows = [row[:n] for row, n in zip(dense.unbind(0), lengths.tolist())]
        return torch.cat(rows), _offsets(lengths).to(dev, non_blocking=True)

    def aten():
        host_offs = _offsets(lengths)
        offs = host_offs.to(dev, non_blocking=True)
        return torch.ops.aten._padded_dense_to_jagged_forward(dense, [offs], int(host_offs[-1])), offs

    def ours():
        return dense_to_flat(dense, lengths)

    def floor():
        return flat[:total].clone(), None

    return {"mask": mask, "narrow+cat": narrow_cat, "aten": aten, "ours": ours, "floor": floor}


def time_interleaved(fns: dict, sync, rounds: int, budget_s: float) -> dict:
    """Minimum seconds per call for each function, rounds interleaved to share any drift."""
    reps = {}
    for name, fn in fns.items():
        fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        reps[name] = max(1, int(budget_s / rounds / max(time.perf_counter() - start, 1e-7)))
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / reps[name])
    return best


def run(shapes, rounds: int, budget_s: float, seed: int = 0) -> list[dict]:
    """Measure every method on every shape; check they all agree first."""
    backend = get_backend()
    dev = backend.device(0)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for B, L, rest in shapes:
        lengths = torch.randint(L // 4, L + 1, (B,), generator=gen)
        dense = torch.randn(B, L, *rest, generator=gen).to(dev)
        fns = make_methods(dense, lengths)
        reference = fns["mask"]()[0]
        for name in ("narrow+cat", "aten", "ours"):
            try:
                got = fns[name]()[0]
            except (NotImplementedError, RuntimeError):
                fns.pop(name)
                continue
            if not torch.equal(got, reference):
                raise RuntimeError(f"{name} disagrees with the boolean-mask result at shape {(B, L, *rest)}")
        times = time_interleaved(fns, backend.synchronize, rounds, budget_s)
        rows.append({"shape": (B, L, *rest), "times": times})
    return rows


def format_table(rows: list[dict], device: str) -> str:
    """One text table: ms and ratio to the floor per method, plus whether ours is fastest."""
    head = f"{'shape (B, L, *rest)':<22}" + "".join(f"{m:>20}" for m in METHODS) + f"{'ours fastest?':>15}"
    lines = [f"dense -> jagged rewrap on {device} (ms, x floor; lengths uniform in [L/4, L])", head, "-" * len(head)]
    for row in rows:
        t = row["times"]
        floor = t["floor"]
        cells = []
        for m in METHODS:
            cells.append(f"{t[m] * 1e3:>11.4f} ({t[m] / floor:>5.2f}x)" if m in t else f"{'n/a':>20}")
        rivals = [t[m] for m in ("mask", "narrow+cat", "aten") if m in t]
        verdict = "yes" if t["ours"] <= 1.1 * min(rivals) else "NO"
        lines.append(f"{str(row['shape']):<22}" + "".join(f"{c:>20}" for c in cells) + f"{verdict:>15}")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Parse flags, measure, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per shape")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (host)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    rounds = args.rounds or (2 if args.quick else 15)
    budget = 0.02 if args.quick else 1.5
    rows = run(shapes, rounds, budget)
    print(format_table(rows, get_backend().name))


if __name__ == "__main__":
    main()
