"""SIGTERM, what schedulers send before preemption: finish the step, checkpoint, stop.

The handler only sets a flag; the job looks at it at each step boundary, where every rank
agrees on it (one all-reduce, so a rank that got no signal stops with the others instead of
waiting in a collective), saves a checkpoint and raises :class:`Preempted`.
"""
from __future__ import annotations

import os
import shlex
import signal
import threading

from ..errors import Preempted
from ..network_waits import unwatch_stop, watch_stop


# The keys a continuation sets itself; the rest of the user's overrides are repeated as given.
_CONTINUATION_KEYS = ("trainer.output_dir", "trainer.resume")


def continue_command(overrides: list[str], output_dir, world_size: int, local_world_size: int | None = None) -> str:
    """The command that continues a stopped run: the same overrides (a default run's output
    directory is a fresh timestamp, so it is named) with ``trainer.resume=auto``. Several nodes
    (``local_world_size``, torchrun's ``LOCAL_WORLD_SIZE``, below the world size): the launcher's
    node count and processes per node, and a note that each node adds its rendezvous arguments
    (not known to the ranks)."""
    kept = [o for o in overrides if o.lstrip("+~").partition("=")[0] not in _CONTINUATION_KEYS]
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    nodes = world_size // local_world_size if 0 < local_world_size < world_size else 1
    if world_size <= 1:
        launcher = ["polyfsdp-train"]
    elif nodes == 1:
        launcher = ["torchrun", f"--nproc_per_node={world_size}", "-m", "polyfsdp.trainer.train"]
    else:
        launcher = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={local_world_size}", "-m",
                    "polyfsdp.trainer.train"]
    command = shlex.join([*launcher, *kept, f"trainer.output_dir={output_dir}", "trainer.resume=auto"])
    return command + (" (on each node, with the rendezvous arguments it was started with)" if nodes > 1 else "")


class StopRequest:
    """A SIGTERM flag and a Ctrl-C that is never lost, installed for the duration of a ``with``
    block (main thread only).

    Ctrl-C raises KeyboardInterrupt at once, as Python's own handler does, and also sets
    ``interrupted``. CPython drops an exception raised while a finalizer or a weakref callback runs
    (it prints "Exception ignored in ..." and carries on), so a Ctrl-C landing there used to be
    lost and the run went on; the job checks the flag at every step boundary and cancellation
    point (:meth:`raise_if_interrupted`) and raises the interrupt there instead.

    Inside the block, waits on a network peer read the SIGTERM flag too (trainer/network_waits.py):
    a judge that does not answer cannot hold a stop up."""

    def __init__(self) -> None:
        self.requested = False
        self.interrupted = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def _interrupt(self, signum, frame) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def raise_if_interrupted(self) -> None:
        """KeyboardInterrupt if a Ctrl-C came whose exception was dropped on its way."""
        if self.interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> "StopRequest":
        watch_stop(self)
        if threading.current_thread() is threading.main_thread():
            self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._handle)}
            # Only where Ctrl-C raises KeyboardInterrupt today: a process started with SIGINT
            # ignored (a background job of a non-interactive shell) keeps ignoring it.
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        unwatch_stop(self)


class StepAbandoned(Exception):
    """A SIGTERM reached a cancellation point of a step that had not updated any weights yet."""


class StepGuard:
    """What a SIGTERM may abandon between one step boundary and the next step's first optimizer
    update: that step's rollout, log-prob passes and gradient accumulation, and an evaluation
    still due at the boundary. Their engines and optimizers are then exactly as at the boundary,
    so the boundary's checkpoint is saved instead of finishing the step (a step on a real
    model outlasts a scheduler's grace period). Once an update has been applied, the step
    runs to its end and the stop happens at the next boundary, as before.

    ``check`` is installed at the engine's cancellation points (engines/cancellation.py); each
    call agrees over ranks (``agreed``: one all-reduce), as every rank reaches the same points.
    """

    def __init__(self, stop: StopRequest, engines, agreed, backend) -> None:
        from polyfsdp.engines.checkpoint.parts import rng_state

        self.stop, self.agreed = stop, agreed
        self.engines = [engine for engine in engines if engine is not None]
        self._steps = [engine.global_step for engine in self.engines]  # optimizer steps so far
        self._backend = backend
        # The generators as at the boundary: the checkpoint saved in the step's place holds them.
        self.rng = rng_state(backend)
        self.updated = False

    def check(self) -> None:
        if self.updated:
            return
        if [engine.global_step for engine in self.engines] != self._steps:
            self.updated = True  # every rank applies the same updates: all stop checking here
            return
        if self.agreed():
            raise StepAbandoned()

    def restore_rng(self) -> None:
        from polyfsdp.engines.checkpoint.parts import set_rng_state

        set_rng_state(self.rng, self._backend)


class SigtermStops:
    """The job's ways of stopping for a SIGTERM (a mixin of trainer/run/job.py's Job, which holds
    ``stop``, ``checkpoints``, ``critic``, ``backend`` and ``_checkpoint``)."""

    def _stop_agreed(self) -> bool:
        """Whether any rank got SIGTERM: all stop at the same point, none waits alone. Agreed on
        the host (gloo): asked before every micro-batch, it must not sync the device."""
        from polyfsdp.backends.distributed import all_reduce_max, host_flag_group

        self.stop.raise_if_interrupted()
        return all_reduce_max([float(self.stop.requested)], device="cpu", group=host_flag_group())[0] > 0

    def _abandonable(self, work, engine, phase, steps_done: int, eval_due, progress, what: str):
        """``work()`` (``what``: e.g. "rl step 3"), abandoned if a SIGTERM reaches one of its
        cancellation points before an update: the run then stops at the boundary after
        ``steps_done`` (``eval_due()``: whether that boundary's evaluation is still to run)."""
        from polyfsdp.engines.cancellation import cancellable

        guard = StepGuard(self.stop, (engine, self.critic), self._stop_agreed, self.backend)
        try:
            with cancellable(guard.check):
                return work()
        except StepAbandoned:
            guard.restore_rng()  # the generators as the boundary's checkpoint would have saved them
            self._preempt(engine, phase, steps_done, eval_due(), progress, abandoned=what)

    def _preempt(self, engine, phase, steps_done: int, eval_due: bool, progress, abandoned: str = "") -> None:
        """Stop at the boundary after ``steps_done``: its checkpoint (saved now unless it is the
        newest one), then :class:`Preempted` naming what the resumed run will do first."""
        progress.close()
        self.checkpoints.written()
        path = self.checkpoints.last if self.checkpoints.last_at == (phase.name, steps_done) else \
            self._checkpoint(engine, phase.name, steps_done, phase.step_offset + steps_done, wait=True,
                             eval_due=eval_due)
        left = [*(["the evaluation due there"] if eval_due else []), *([abandoned] if abandoned else [])]
        raise Preempted(phase.name, steps_done, path, f"left for the resumed run: {', '.join(left)}" if left else "")
