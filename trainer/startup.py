"""What ``polyfsdp-train`` says when Ctrl-C lands while it is still starting (importing torch
and transformers takes seconds): one line and exit status 130, never an import traceback.

Kept free of heavy imports: ``trainer/__init__.py`` uses it around the first ``import torch``.
"""
from __future__ import annotations

import sys

# Stopped by Ctrl-C (SIGINT), the shell's convention 128 + 2.
EXIT_INTERRUPTED = 130


def interrupted_while_starting() -> SystemExit:
    """Print the one line and return the SystemExit (status 130) to raise or read."""
    print("polyfsdp-train: interrupted while starting (nothing ran, nothing was written)", file=sys.stderr,
          flush=True)
    return SystemExit(EXIT_INTERRUPTED)


def rank_prefix(rank: int, prog: str = "polyfsdp-train") -> str:
    """How ``prog`` starts an error line on ``rank`` (torch-free: config errors print it early)."""
    return f"{prog}: error: " if rank == 0 else f"{prog} [rank {rank}]: error: "
