"""An RL step's completions, with DAPO's dynamic sampling when ``algo.actor.filter_groups``:
groups whose rewards are all equal carry no signal and are dropped, and sampling goes on
(with further prompts) until every rank holds its share of ``prompts_per_step`` groups or
``max_sample_batches`` rounds are spent. Every rank keeps the same number of groups (the
smallest count over ranks), so all take the same number of optimizer steps."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from polyfsdp.backends.distributed import all_reduce_max, all_reduce_sum

from .engines import Completions, SamplingParams
from .drivers.result import Rollout
from .row_seeds import RowSeeds
from ..data.example import Example

logger = logging.getLogger(__name__)


@dataclass
class SampledGroups:
    """``kept``: the completions to train on; ``first``: the first round, as sampled (the
    reward metrics are taken over it, comparable with or without filtering)."""

    kept: Rollout
    first: Rollout
    metrics: dict = field(default_factory=dict)


def _informative(roll: Rollout, n: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal."""
    return [i for i in range(len(roll.rewards) // n) if len(set(roll.rewards[i * n:(i + 1) * n])) > 1]


def _select(roll: Rollout, groups: list[int], n: int) -> Rollout:
    rows = [i * n + j for i in groups for j in range(n)]
    pick = lambda values: None if values is None else [values[r] for r in rows]  # noqa: E731
    return Rollout(pick(roll.prompt_ids), pick(roll.response_ids), pick(roll.texts), pick(roll.rewards),
                   {k: pick(v) for k, v in roll.reward_metrics.items()}, pick(roll.log_probs),
                   answers=pick(roll.answers), loss_masks=pick(roll.loss_masks), rollout_metrics=roll.rollout_metrics,
                   images=pick(roll.images))


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """One rollout of ``parts``' rows, in order (also the agent driver's rounds, drivers/agent.py)."""
    join = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
    log_probs = None if parts[0].log_probs is None else join("log_probs")
    loss_masks = None if parts[0].loss_masks is None else join("loss_masks")
    answers = None if parts[0].answers is None else join("answers")
    images = None if all(p.images is None for p in parts) else \
        [x for p in parts for x in (p.images if p.images is not None else [None] * len(p.prompt_ids))]
    keys = parts[0].reward_metrics.keys()
    return Rollout(join("prompt_ids"), join("response_ids"), join("texts"), join("rewards"),
                   {k: [x for p in parts for x in p.reward_metrics.get(k, [])] for k in keys}, log_probs,
                   answers=answers, loss_masks=loss_masks, images=images,
                   rollout_metrics={k: [x for p in parts for x in p.rollout_metrics.get(k, [])]
                                    for k in parts[0].rollout_metrics})


@dataclass(frozen=True)
class GroupSampling:
    """How an RL step samples, as one value: ``params`` for every completion, ``group_size`` of
    them per prompt and DAPO's group filtering (``filter_groups``, at most ``max_sample_batches``
    rounds)."""

    params: SamplingParams
    group_size: int
    filter_groups: bool = False
    max_sample_batches: int = 1

    @classmethod
    def of(cls, tokenizer, g, log_probs: bool) -> "GroupSampling":
        """The actor section ``g``'s settings, the sampler's log-probs when asked."""
        params = SamplingParams.for_tokenizer(tokenizer, g.max_new_tokens, temperature=g.temperature,
                                              return_log_probs=log_probs, **g.sampling_options())
        return cls(params, g.group_size, g.filter_groups, g.max_sample_batches)


def sample_groups(policy, tokenizer, examples: list[Example], sampling: GroupSampling, driver, scorer=None,
                  more_examples: Callable[[int], list[Example]] | None = None, row_seeds: RowSeeds | None = None,
                  prefetched: Completions | None = None) -> SampledGroups:
    """Sample ``sampling.group_size`` completions per prompt of ``examples`` (this rank's share);
    with ``sampling.filter_groups``, keep only informative groups, resampling as described above.
    ``driver`` runs the rollouts (trainer/rollout/drivers/), its engine already at the policy's
    weights (``update_weights``); ``row_seeds``: the step's per-row sampling seeds (round k's rows
    get round k's), else the process's generator draws. ``prefetched``: round 0's completions,
    already generated (trainer/algos/sample_ahead.py generates them beside a step's training)."""
    n, params = sampling.group_size, sampling.params

    def draw(batch, sampling_round, prefetched=None):
        seeds = None if row_seeds is None else row_seeds.rows(sampling_round, len(batch), n)
        more = {} if prefetched is None else {"prefetched": prefetched}
        return driver.rollout(tokenizer, batch, n, params, scorer=scorer, row_seeds=seeds, device=policy.device, **more)

    first = draw(examples, 0, prefetched)
    if not sampling.filter_groups:
        return SampledGroups(first, first)
    target, device = len(examples), policy.device
    kept, count, rounds, roll = [], 0, 1, first
    while True:
        groups = _informative(roll, n)[:target - count]
        kept.append(_select(roll, groups, n))
        count += len(groups)
        # Generation is collective (synced over ranks): every rank samples while any one is short.
        short = all_reduce_max([float(target - count)], device)[0]
        if short <= 0 or rounds >= sampling.max_sample_batches or more_examples is None:
            break
        roll = draw(more_examples(rounds), rounds)
        rounds += 1
    common = int(-all_reduce_max([-float(count)], device)[0])
    kept_roll = _select(concat_rollouts(kept), list(range(common)), n)
    total = all_reduce_sum([float(common)], device)[0]
    if common < target:
        logger.warning("filter_groups: %d of %d groups per rank carry a reward signal after %d sampling rounds "
                       "(algo.actor.max_sample_batches); training on those", common, target, rounds)
    return SampledGroups(kept_roll, first, {"filter/groups": total, "filter/sample_rounds": float(rounds),
                                            "filter/short": float(common < target)})
