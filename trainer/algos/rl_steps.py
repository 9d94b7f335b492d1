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
from ..rollout.sampling import sampling_params
from . import rl_step as steps


@dataclass
class RLSteps:
    """What every RL step of a phase shares. ``examples(t)``: this rank's prompts of step ``t``;
    ``refill(t, k)``: its k-th extra batch for group filtering; ``first_prompt(t)``: the global
    index of this rank's first prompt (its rows' seeds); ``warmup``: steps that train only the
    critic; ``samples``: trainer.log_rollout_samples; ``teacher``: algo.distill's teacher engine."""

    policy: object
    ref: object
    tokenizer: object
    algo: object
    actor_loss: object
    mini_batches: int
    scorer: object
    driver: object
    seed: int
    replica: int
    examples: Callable[[int], list]
    refill: Callable[[int, int], list]
    first_prompt: int
    critic: object = None
    value_loss: object = None
    warmup: int = 0
    samples: int = 0
    teacher: object = None

    def row_seeds(self, step: int) -> RowSeeds:
        return RowSeeds(self.seed, step, first_prompt=self.first_prompt)

    def sample_seed(self, step: int) -> int:
        """The process's generators at step ``step``'s sampling (what else draws: dropout)."""
        return replica_seed(self.seed, step, self.replica)

    def run(self, step: int, examples: list) -> dict:
        """One synchronous step: sync, sample, train (``rl_step``)."""
        return steps.rl_step(self.policy, self.ref, self.tokenizer, examples, self.algo, self.actor_loss,
                             row_seeds=self.row_seeds(step), sample_seed=self.sample_seed(step),
                             shuffle_seed=step_seed(self.seed, step), mini_batches=self.mini_batches,
                             scorer=self.scorer, more_examples=lambda k: self.refill(step, k), driver=self.driver,
                             critic=self.critic, value_loss=self.value_loss, train_actor=step >= self.warmup,
                             samples=self.samples, teacher=self.teacher)

    def sample(self, step: int, prefetched=None, prefetch_s: float = 0.0) -> steps.SampledBatch:
        """Step ``step``'s batch from the driver's engine as it is now (``prefetched``: its first
        round's completions, from :meth:`prefetch_request`, generated in ``prefetch_s``). Collective."""
        return steps.sample_batch(self.policy, self.tokenizer, self.examples(step), self.algo,
                                  self.sample_seed(step), self.scorer, lambda k: self.refill(step, k), self.driver,
                                  self.row_seeds(step), self.samples, prefetched=prefetched, prefetch_s=prefetch_s)

    def prefetch_request(self, step: int) -> tuple | None:
        """``(prompts, params, seeds)`` of step ``step``'s first sampling round when the engine may
        generate it beside training (a rollout server's; a single-turn driver); else None."""
        prompts_of = getattr(self.driver, "prompts", None)
        if not self.driver.engine.samples_beside_training or prompts_of is None:
            return None
        examples, n = self.examples(step), self.algo.actor.group_size
        params = sampling_params(self.tokenizer, self.algo.actor, self.algo.rollout_correction.needs_rollout_log_probs)
        return prompts_of(self.tokenizer, examples, n), params, self.row_seeds(step).rows(0, len(examples), n)

    def train(self, step: int, batch: steps.SampledBatch, timing: dict) -> dict:
        """Step ``step``'s advantages and updates on ``batch``, and its record."""
        return steps.train_batch(self.policy, self.ref, self.tokenizer, batch, self.algo, self.actor_loss,
                                 step_seed(self.seed, step), self.mini_batches, self.critic, self.value_loss,
                                 step >= self.warmup, timing=timing, teacher=self.teacher)
