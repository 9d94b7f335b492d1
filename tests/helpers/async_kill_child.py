"""`polyfsdp-train` killed with SIGKILL in the middle of a background checkpoint write.

Usage: python async_kill_child.py STEP [overrides...] (with trainer.async_checkpoint=true). The
write of GRPO step STEP's shards waits until training has logged step STEP + 1 (so the step ran
while the save was pending), then the process sends itself SIGKILL: no cleanup, no flush, the
checkpoint's directory left as the kill found it."""
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from polyfsdp.engines.checkpoint import TMP_PREFIX, step_dir_name
from polyfsdp.trainer import train
from polyfsdp.trainer.tracking.metrics import read_metrics

STEP = int(sys.argv[1])
real_write = FileSystemWriter.write_data


def write_then_die(self, plan, planner):
    target = Path(self.path)
    if target.name == f"{TMP_PREFIX}{step_dir_name(STEP)}" and target.parent.name == "rl":
        metrics = target.parent.parent.parent / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not any(r.get("phase") == "rl" and r.get("step") == STEP + 1
                      for r in (read_metrics(str(metrics)) if metrics.is_file() else [])):
            if time.monotonic() > deadline:
                raise SystemExit(f"rl step {STEP + 1} never logged while step {STEP}'s save was pending")
            time.sleep(0.05)
        print(f"KILL during the background write of {target}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(self, plan, planner)


FileSystemWriter.write_data = write_then_die
sys.exit(train.main(sys.argv[2:]))
