"""Live progress: a tqdm bar on a terminal, plain periodic lines otherwise (CI, logs)."""
from __future__ import annotations

import sys
import time

# Short names shown in the bar, in this order, when a step reports them.
SHOWN = (("reward", "reward"), ("loss", "loss"), ("entropy", "ent"), ("kl", "kl"), ("tokens_per_s", "tok/s"))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


class Progress:
    """One phase's progress. ``mode``: bar | lines | off (auto picks bar on a TTY)."""

    def __init__(self, phase: str, total: int, start: int = 0, mode: str = "auto", enabled: bool = True) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if enabled else "off"
        self.phase, self.total, self.step = phase, total, start
        self.every = max(1, total // 10)
        self.t0 = time.perf_counter()
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=phase, dynamic_ncols=True, leave=True)

    def update(self, metrics: dict) -> None:
        """Advance one step and show its metrics."""
        self.step += 1
        shown = {short: _fmt(metrics[key]) for key, short in SHOWN if key in metrics}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif self.mode == "lines" and (self.step % self.every == 0 or self.step == self.total):
            text = " ".join(f"{k}={v}" for k, v in shown.items())
            print(f"[{self.phase}] step {self.step}/{self.total} {text} ({time.perf_counter() - self.t0:.1f}s)",
                  flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
