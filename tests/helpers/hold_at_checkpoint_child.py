"""`polyfsdp-train` that pauses after one chosen checkpoint until its parent writes a line to its
stdin, then finishes the run, so the parent can start a second run while this one is known to be
in the middle of writing its output directory.

Usage: python hold_at_checkpoint_child.py PHASE STEP [overrides...]; prints ``HOLDING`` when paused."""
import sys

from polyfsdp.trainer import train
from polyfsdp.trainer.run import job

PHASE, STEP = sys.argv[1], int(sys.argv[2])
save_and_announce = job.Job._checkpoint


def checkpoint_then_pause(self, engine, phase, step, global_step, **kwargs):
    path = save_and_announce(self, engine, phase, step, global_step, **kwargs)
    if (phase, step) == (PHASE, STEP):
        print("HOLDING", flush=True)
        sys.stdin.readline()
    return path


job.Job._checkpoint = checkpoint_then_pause
sys.exit(train.main(sys.argv[3:]))
