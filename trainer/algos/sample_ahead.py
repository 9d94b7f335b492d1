"""Asynchronous RL with a bounded staleness (``rollout.max_staleness`` = k > 0): RL step ``t``
trains on a batch sampled with the policy of step ``max(0, t - k)``, so the next batch is
sampled while this step trains.

Step ``t`` of the pipeline::

    queue            batches t .. t+k-1, sampled (the phase's first k with the starting weights)
    sync             the rollout engine takes the policy's weights: version t (t updates done)
    sample t+k       a rollout server's engine: its first round generated on a background
                     thread (HTTP requests only: no device, no collective) while the trainer
                     trains; a colocated engine (builtin, hf, vllm) shares the trainer's
                     device: it samples now, before the update
    train t          advantages and updates on batch t (drawn with version max(0, t - k))
    collect t+k      wait for the background round (rollout.server.request_timeout_s bounds
                     each request), then score, filter groups and reduce the metrics on the
                     main thread (reward functions keep the main thread, ranks their
                     collectives); batch t leaves the queue, batch t+k joins it

Nothing is in flight at a step boundary, so a checkpoint, an evaluation or a SIGTERM stop sees
a complete queue: the checkpoint stores it (``state``/``load``) and a resumed run trains on the
same batches as the uninterrupted one. Every batch is drawn with exactly the version above:
staleness is ``min(t, k)``, never more, so no batch is past the bound (nothing to drop); the
sampler's log-probs correct the difference (algo.rollout_correction). One batch is generated
at a time: a larger k delays the samples more without overlapping more (the weights change at
every step, and a server holds one version).
"""
from __future__ import annotations

import threading
import time

from polyfsdp.engines.cancellation import cancellation_point

from ..errors import ConfigError
from ..rank_errors import on_every_rank, rank_local
from .rl_step import SampledBatch
from .rl_steps import RLSteps


def resume_sampled_ahead(pipeline: "SampleAhead | None", position, rank: int, world: int, say) -> None:
    """Give ``pipeline`` (None: a synchronous run) this rank's batches sampled ahead in the
    checkpoint ``position``; says so in one line whenever rollout.max_staleness differs from the
    value the checkpoint was saved with (and how many batches sampled ahead it leaves out: they are
    sampled again with the current weights, so the bound holds for the resumed run's k)."""
    now = 0 if pipeline is None else pipeline.k
    left_out = 0
    if pipeline is not None:
        left_out = pipeline.load(position.rank_queue(rank, world), position.phase_step)
    elif position.sampled_ahead:
        left_out = len(position.sampled_ahead[0] or [])
    line = staleness_change_line(position.max_staleness, now, left_out)
    if line is not None:
        say(line)


def staleness_change_line(before: int | None, now: int, left_out: int) -> str | None:
    """The line of a resume whose rollout.max_staleness is ``now``, the checkpoint's ``before``
    (None: a checkpoint saved without it, of an older polyfsdp or of the SFT phase); ``left_out``:
    the checkpoint's batches sampled ahead this run does not train on. None when nothing changed."""
    if now == 0:
        meaning = "each step samples its batch with its own weights (synchronous, on policy)"
    else:
        meaning = (f"step t trains on a batch sampled by the policy of step t - {now} (asynchronous; "
                   f"algo.rollout_correction corrects for it)")
    dropped = "" if not left_out else (f"; the checkpoint's {left_out} batch(es) sampled ahead are beyond it: "
                                       f"sampled again with the current weights")
    if before is None:  # the change is known only from what the checkpoint holds
        return None if not left_out else f"resume: rollout.max_staleness={now}: {meaning}{dropped}"
    if before == now:
        return None
    return f"resume: rollout.max_staleness {before} -> {now}: {meaning}{dropped}"


class BackgroundRound:
    """A first sampling round generated on a daemon thread (a process that stops never waits
    for it); :meth:`wait` returns its completions or raises its error."""

    def __init__(self, engine, prompts, params, seeds, images=None) -> None:
        self.started, self.done_at = time.perf_counter(), None
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(engine, prompts, params, seeds, images), daemon=True,
                                       name="polyfsdp-sample-ahead")
        self.thread.start()

    def _run(self, engine, prompts, params, seeds, images) -> None:
        try:
            with rank_local():  # the main thread agrees on the outcome over ranks (wait())
                more = {} if images is None else {"images": images}  # as the driver's own call
                self.result = engine.generate(prompts, params, seeds, **more)
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            self.error = exc
        finally:
            self.done_at = time.perf_counter()

    def wait(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


class SampleAhead:
    """The pipeline of one RL phase of ``total`` steps with staleness ``k`` (see the module)."""

    def __init__(self, steps: RLSteps, k: int, total: int) -> None:
        self.steps, self.k, self.total = steps, k, total
        self.queue: dict[int, SampledBatch] = {}  # step -> its batch, sampled
        self.background: BackgroundRound | None = None

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> list[dict]:
        """The queue as plain data (this rank's share), oldest first."""
        return [{"step": step, **batch.to_plain()} for step, batch in sorted(self.queue.items())]

    def load(self, plain: list[dict] | None, at_step: int) -> int:
        """Take back a checkpoint's queue, saved at the boundary before step ``at_step``, except the
        batches this run's k would not have drawn (resumed with a smaller rollout.max_staleness:
        staler than k, or more than k steps ahead), which are sampled again; returns how many."""
        self.queue, left_out = {}, 0
        for entry in plain or []:
            step = int(entry["step"])
            if step < at_step:
                raise ConfigError(f"trainer.resume: the checkpoint's queue holds a batch of step {step + 1}, "
                                  f"before its own step {at_step}; the checkpoint is damaged")
            batch = SampledBatch.from_plain(entry)
            if step - batch.version > self.k or step >= at_step + self.k:
                left_out += 1
                continue
            self.queue[step] = batch
        return left_out

    # ------------------------------------------------------------------ steps
    def step(self, t: int, examples: list | None = None) -> dict:
        """Train RL step ``t`` (0-based) on its queued batch; sample step ``t + k``'s meanwhile."""
        t0 = time.perf_counter()
        engine = self.steps.ctx.driver.engine
        ahead = t + self.k
        missing = [s for s in range(t, min(ahead, self.total)) if s not in self.queue]
        if missing or ahead < self.total:  # the last k steps sample nothing
            engine.update_weights(self.steps.ctx.policy)  # version t: the weights of what is sampled now
        sync_s = time.perf_counter() - t0
        waited = 0.0
        # The phase's first k batches (and those of a checkpoint saved without any) are drawn now.
        for s in missing:
            self.queue[s] = self._stamp(self.steps.sample(s), t)
            waited += self.queue[s].gen_time_s
        fresh, sampler_busy, overlapped = None, waited, False
        try:
            if ahead < self.total:
                request = self.steps.prefetch_request(ahead)
                if request is None:  # a colocated engine: the trainer's device samples first
                    fresh = self._stamp(self.steps.sample(ahead), t)
                    waited += fresh.gen_time_s
                    sampler_busy += fresh.gen_time_s
                else:
                    overlapped = True
                    self.steps.ctx.policy.backend.manual_seed(self.steps.seeds(ahead).sample)  # as a colocated draw
                    self.background = BackgroundRound(engine, *request)
            cancellation_point()  # a SIGTERM during the sampling stops before the update (job: StepGuard)
            batch = self.queue[t]
            metrics = self.steps.train(t, batch, timing={"weight_sync_time_s": sync_s, "started": t0})
            if self.background is not None:
                round_, started = self.background, time.perf_counter()
                completions = on_every_rank(round_.wait)
                # Scoring, group filtering's further rounds and the metrics: the trainer waits for them too.
                fresh = self._stamp(self.steps.sample(ahead, prefetched=completions,
                                                      prefetch_s=round_.done_at - round_.started), t)
                waited += time.perf_counter() - started
                sampler_busy += fresh.gen_time_s
        finally:
            self.background = None  # a stopped step's round is left to its thread
        # The step is done: only now does the queue move (a step abandoned above leaves it whole).
        del self.queue[t]
        if fresh is not None:
            self.queue[ahead] = fresh
        step_time = time.perf_counter() - t0
        metrics.update({"step_time_s": step_time, "async/staleness": float(t - batch.version),
                        "async/trainer_wait_time_s": waited, "async/overlapped": float(overlapped),
                        "async/sampler_idle_time_s": max(step_time - sampler_busy, 0.0)})
        return metrics

    @staticmethod
    def _stamp(batch: SampledBatch, version: int) -> SampledBatch:
        batch.version = version
        return batch
