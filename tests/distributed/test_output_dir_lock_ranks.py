"""Two ranks under torchrun and the output directory's lock (trainer/output_dir_lock.py): rank 0
takes it and the other rank learns the outcome, so a directory another run holds stops both ranks
with one line, and a lock left by a killed run is taken over once and released at the end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

from torchrun_launcher import free_port

from polyfsdp.trainer.output_dir_lock import LOCK_FILE, Holder, start_time

OVERRIDES = ["algo=sft", "trainer.sft_steps=1", "trainer.sft_batch_size=8", "data.eval_size=8", "trainer.progress=off",
             "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0"]


def _torchrun(out) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "polyfsdp.trainer.train", *OVERRIDES,
               f"trainer.output_dir={out}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def _lock(out, pid: int) -> Holder:
    holder = replace(Holder.this_process(), pid=pid, started=start_time(pid))
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps(asdict(holder)))
    return holder


def test_a_directory_another_run_holds_stops_both_ranks_in_one_line(tmp_path):
    other_run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        holder = _lock(tmp_path / "o", other_run.pid)
        proc = _torchrun(tmp_path / "o")
    finally:
        other_run.kill()
        other_run.wait()
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("polyfsdp-train")]
    assert ours == [f"polyfsdp-train: error: rank 0: trainer.output_dir {tmp_path / 'o'}: another run is writing to "
                    f"it ({holder.describe()}); wait for it to end or choose another trainer.output_dir"], \
        proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [LOCK_FILE]  # nothing written


def test_a_killed_runs_lock_is_taken_over_once_and_released(tmp_path):
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()
    holder = _lock(tmp_path / "o", killed.pid)
    proc = _torchrun(tmp_path / "o")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("took over the lock") == 1 and holder.describe() in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "o" / "metrics.jsonl").is_file() and not (tmp_path / "o" / LOCK_FILE).exists()
