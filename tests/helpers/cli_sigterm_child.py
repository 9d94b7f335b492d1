"""`polyfsdp-train` that sends itself SIGTERM at a chosen point (what a scheduler does before
preemption), through the real signal handler.

Usage: python cli_sigterm_child.py PHASE STEP [overrides...]. ``SIGTERM_AT`` says when:
``record`` (default) once step STEP of PHASE is done and recorded; ``rollout`` while RL step
STEP samples (before any update); ``eval`` as the evaluation after PHASE step STEP starts,
``eval_end`` as it ends (its records written).
Under torchrun, only the rank named by SIGTERM_RANK (default: every rank) gets the signal."""
import os
import signal
import sys

from polyfsdp.trainer.algos import rl_step
from polyfsdp.trainer.run import job
from polyfsdp.trainer import train

PHASE, STEP = sys.argv[1], int(sys.argv[2])
AT = os.environ.get("SIGTERM_AT", "record")


def terminate() -> None:
    if os.environ.get("SIGTERM_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0"):
        os.kill(os.getpid(), signal.SIGTERM)


record = job.Job._record


def record_then_terminate(self, phase, step, global_step, metrics, progress):
    record(self, phase, step, global_step, metrics, progress)
    if (phase, step) == (PHASE, STEP):
        terminate()


sample_groups, rollouts = rl_step.sample_groups, []


def terminate_while_sampling(*args, **kwargs):
    rollouts.append(1)
    if len(rollouts) == STEP:
        terminate()
    return sample_groups(*args, **kwargs)


evaluate = job.Job._evaluate


def evaluate_and_terminate(self, engine, tag, global_step, where=None):
    if where == f"{PHASE} step {STEP}" and AT == "eval":
        terminate()
    reward = evaluate(self, engine, tag, global_step, where=where)
    if where == f"{PHASE} step {STEP}" and AT == "eval_end":
        terminate()
    return reward


if AT == "record":
    job.Job._record = record_then_terminate
elif AT == "rollout":
    rl_step.sample_groups = terminate_while_sampling
elif AT in ("eval", "eval_end"):
    job.Job._evaluate = evaluate_and_terminate
else:
    raise SystemExit(f"SIGTERM_AT={AT}: record, rollout, eval or eval_end")
sys.exit(train.main(sys.argv[3:]))
