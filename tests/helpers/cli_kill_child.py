"""`polyfsdp-train` that holds still after one chosen checkpoint until its parent kills it.

Usage: python cli_kill_child.py PHASE STEP [overrides...]. After the checkpoint of (PHASE,
STEP) is saved and announced, the process blocks on stdin (the parent keeps it open), so a
SIGKILL lands at a known point however loaded the machine is; without the hold the run
finished its last steps before the kill arrived now and then."""
import sys

from polyfsdp.trainer.run import job
from polyfsdp.trainer import train

PHASE, STEP = sys.argv[1], int(sys.argv[2])
save_and_announce = job.Job._checkpoint


def checkpoint_then_hold(self, engine, phase, step, global_step, **kwargs):
    save_and_announce(self, engine, phase, step, global_step, **kwargs)
    if (phase, step) == (PHASE, STEP):
        sys.stdout.flush()
        sys.stdin.read()  # never returns: the parent holds stdin open and kills this process
        raise SystemExit("stdin closed before the kill")


job.Job._checkpoint = checkpoint_then_hold
sys.exit(train.main(sys.argv[3:]))
