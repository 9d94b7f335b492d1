"""The RL phase's steps as the job runs them: which prompts, seeds and engines step ``t`` uses,
synchronously (:meth:`RLSteps.run`: trainer/algos/rl_step.py's ``rl_step``) or in the pieces the
asynchronous pipeline (trainer/algos/sample_ahead.py) runs apart: sample step ``s``'s batch,
prefetch its first round, train step ``t`` on a batch.

Every prompt batch and seed is a function of the step alone, so a batch sampled ahead is the
batch its step would have drawn, whenever it is drawn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..rollout.row_seeds import RowSeeds, replica_seed, step_seed
from . import rl_step as steps


@dataclass
class RLSteps:
    """What every RL step of a phase shares: ``ctx`` (the engines, losses and settings,
    trainer/algos/rl_step.py's RLContext) and what derives each step's prompts and seeds.
    ``examples(t)``: this rank's prompts of step ``t``; ``refill(t, k)``: its k-th extra batch for
    group filtering; ``first_prompt``: the global index of this rank's first prompt (its rows'
    seeds); ``warmup``: steps that train only the critic."""

    ctx: steps.RLContext
    seed: int
    replica: int
    examples: Callable[[int], list]
    refill: Callable[[int, int], list]
    first_prompt: int
    warmup: int = 0

    def seeds(self, step: int) -> steps.StepSeeds:
        """Step ``step``'s seeds: the process's generators at its sampling (what else draws:
        dropout), each row's and the mini-batch order's."""
        return steps.StepSeeds(sample=replica_seed(self.seed, step, self.replica), shuffle=step_seed(self.seed, step),
                               rows=RowSeeds(self.seed, step, first_prompt=self.first_prompt))

    def run(self, step: int, examples: list) -> dict:
        """One synchronous step: sync, sample, train (``rl_step``)."""
        return steps.rl_step(self.ctx, examples, self.seeds(step), lambda k: self.refill(step, k),
                             train_actor=step >= self.warmup)

    def sample(self, step: int, prefetched=None, prefetch_s: float = 0.0) -> steps.SampledBatch:
        """Step ``step``'s batch from the driver's engine as it is now (``prefetched``: its first
        round's completions, from :meth:`prefetch_request`, generated in ``prefetch_s``). Collective."""
        return steps.sample_batch(self.ctx, self.examples(step), self.seeds(step), lambda k: self.refill(step, k),
                                  prefetched=prefetched, prefetch_s=prefetch_s)

    def prefetch_request(self, step: int) -> tuple | None:
        """``(prompts, params, seeds, images)`` of step ``step``'s first sampling round when the engine
        may generate it beside training (a rollout server's; a single-turn driver); else None.
        ``images``: the rows' examples when a prompt holds images, else None (the driver's ``row_images``)."""
        driver = self.ctx.driver
        prompts_of = getattr(driver, "prompts", None)
        if not driver.engine.samples_beside_training or prompts_of is None:
            return None
        examples, n = self.examples(step), self.ctx.sampling.group_size
        return prompts_of(self.ctx.tokenizer, examples, n), self.ctx.sampling.params, \
            self.seeds(step).rows.rows(0, len(examples), n), getattr(driver, "row_images", lambda *_: None)(examples, n)

    def train(self, step: int, batch: steps.SampledBatch, timing: dict) -> dict:
        """Step ``step``'s advantages and updates on ``batch``, and its record."""
        return steps.train_batch(self.ctx, batch, step_seed(self.seed, step), step >= self.warmup, timing=timing)
