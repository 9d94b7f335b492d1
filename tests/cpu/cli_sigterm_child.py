"""`polyfsdp-train` that sends itself SIGTERM once a chosen step is done (what a scheduler does
before preemption), through the real signal handler.

Usage: python cli_sigterm_child.py PHASE STEP [overrides...]. Under torchrun, only the rank named
by SIGTERM_RANK (default: every rank) gets the signal."""
import os
import signal
import sys

from polyfsdp.trainer.run import job
from polyfsdp.trainer import train

PHASE, STEP = sys.argv[1], int(sys.argv[2])
record = job.Job._record


def record_then_terminate(self, phase, step, global_step, metrics, progress):
    record(self, phase, step, global_step, metrics, progress)
    if (phase, step) == (PHASE, STEP) and os.environ.get("SIGTERM_RANK", os.environ.get("RANK", "0")) == \
            os.environ.get("RANK", "0"):
        os.kill(os.getpid(), signal.SIGTERM)


job.Job._record = record_then_terminate
sys.exit(train.main(sys.argv[3:]))
