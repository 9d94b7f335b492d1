"""Waiting for a child ``polyfsdp-train`` that must end by itself (a deadline or a stop that holds):
shared by the judge's and the rollout servers' stop tests."""
from __future__ import annotations

import subprocess

import pytest


def finish_within(proc: subprocess.Popen, timeout_s: float) -> tuple[int, list[str]]:
    """``(exit status, non-blank stderr lines)`` of ``proc`` once it ends; killed and the test failed
    (with its stderr's tail) if it is still running ``timeout_s`` seconds later."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running {timeout_s} s later; stderr: {err[-2000:]}")
    return proc.returncode, [line for line in err.splitlines() if line.strip()]
