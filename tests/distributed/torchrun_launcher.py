"""Run a worker script under torchrun from a test, with a free port, on the CPU (gloo) unless a
test names another backend (``backend=``, from the ``dist_backend`` fixture in conftest.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.helpers import root_on_pythonpath


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: str, nproc: int = 2, args: tuple[str, ...] = (), timeout: float = 300,
                 env_extra: dict | None = None, backend: str = "cpu") -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` local processes with ``POLYFSDP_BACKEND=backend`` (the
    workers' ``get_backend()``); returns the finished process."""
    env = dict(os.environ)
    env.update({"POLYFSDP_BACKEND": backend, "OMP_NUM_THREADS": "1"})
    env = root_on_pythonpath(env)  # workers import tests.helpers
    env.update(env_extra or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def run_and_load(script: str, out_dir, nproc: int, args: tuple[str, ...], filename: str, timeout: float = 900):
    """Run a worker that saves into ``out_dir`` (its first argument), fail with the ranks'
    own error lines when it fails, and load what it saved as ``filename``."""
    import torch

    result = run_torchrun(script, nproc=nproc, args=(str(out_dir), *args), timeout=timeout)
    # The root cause sits in the ranks' own tracebacks, before torchrun's summary.
    causes = [line for line in result.stderr.splitlines() if "Error" in line or "error" in line][:20]
    assert result.returncode == 0, "\n".join(causes) + "\n" + result.stderr[-3000:]
    return torch.load(os.path.join(str(out_dir), filename))
