"""``polyfsdp-train`` that SIGKILLs itself at a chosen point of a chosen RL step: the kill -9 +
resume tests of asynchronous RL (test_async_resume.py).

Usage: python async_rl_kill_child.py POINT STEP [overrides...], POINT one of ``sampling`` (the
batch sampled ahead during step STEP), ``sync`` (the rollout engine's weight update at its
start), ``update`` (its optimizer step), ``checkpoint`` (the checkpoint after it, its shards
written, before it is complete)."""
import os
import signal
import sys

from polyfsdp.engines import FSDPEngine
from polyfsdp.engines import checkpoint as engine_checkpoint
from polyfsdp.trainer import train
from polyfsdp.trainer.algos.rl_steps import RLSteps
from polyfsdp.trainer.algos.sample_ahead import SampleAhead
from polyfsdp.trainer.rollout.engines import PolicyDecoding

POINT, STEP = sys.argv[1], int(sys.argv[2])
current = {"step": 0}  # the RL step (1-based) running now


def kill_if(point: str) -> None:
    if point == POINT and current["step"] == STEP:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def patch(owner, name: str, point: str, before=None) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        kill_if(point)
        return original(*args, **kwargs)
    setattr(owner, name, wrapped)


patch(SampleAhead, "step", "", before=lambda self, t, *rest: current.update(step=t + 1))
patch(RLSteps, "sample", "sampling")
patch(PolicyDecoding, "update_weights", "sync")
patch(FSDPEngine, "train_batch", "update")
save_plain = engine_checkpoint.save_plain


def save_then_maybe_kill(state, path, *args, **kwargs):
    # The trainer state is the last file a checkpoint writes before its commit (engines/checkpoint/).
    if "trainer_state" in str(path):
        kill_if("checkpoint")
    return save_plain(state, path, *args, **kwargs)


engine_checkpoint.save_plain = save_then_maybe_kill
sys.exit(train.main(sys.argv[3:]))
