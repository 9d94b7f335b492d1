"""What the tests share: reference implementations, cases, stand-ins and the scripts tests run as
child processes (by path: ``HELPERS / "name.py"``). Import them as ``tests.helpers.NAME``."""
import os
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]  # the repository root


def root_on_pythonpath(env: dict) -> dict:
    """``env`` (a child process's environment) with the repository root first on PYTHONPATH: a
    script run by path (a torchrun worker) imports ``tests.helpers`` through it."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)}
