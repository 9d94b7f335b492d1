"""One RL step, for every advantage estimator and policy loss (verl's order)::

    update_weights (rollout engine)  the engine takes the policy's weights (a sync when it holds a copy)
    sample_groups (sampling.py)      generate + score (DAPO's group filtering when asked); the
                                     engine then sleeps (frees its device memory for training)
    old log-probs, ref log-probs     policy / reference infer_batch: old ones when the loss is off
                                     policy (several updates per rollout), the estimator reads them
                                     or puts the KL into the reward, or a teacher distils; ref ones
                                     whenever there is a reference (kl_coef > 0)
    teacher log-probs                the distillation teacher's infer_batch, iff algo.distill.teacher
    values                           critic.infer_values, iff the estimator needs a critic
    advantages (estimators.py)       the registered estimator, from the declarations above, plus
                                     -coef x the per-token reverse KL to the teacher (distill/)
    critic updates                   run_updates(critic, ValueLoss), iff a critic
    actor updates                    run_updates(policy, policy loss) on the same plan, after the
                                     critic's warm-up (train_actor)

One record: the rollout's reward metrics, the critic's (``vf_``-prefixed where a name is the
actor's too), the actor's update summary, and with more than one update per rollout one record
per update (``update_metrics``) holding both engines' numbers.

An empty completion (no response token to train on: an aborted generation) is counted
(``empty_completions``), left out of its group's statistics (advantages.py) and of the loss (its
mask is 0); an optimizer step of the plan whose rows hold no token on any rank is dropped (the
losses normalise by that count), and a step whose rows are all empty takes no update
(``skipped_empty``, ``updates`` 0, one line: :func:`empty_step_warning`).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from polyfsdp.backends.distributed import all_reduce_sum, sum_over_replicas
from polyfsdp.engines.cancellation import cancellation_point

from ..data.batch import build_batch, per_sequence, response_field, response_mask
from ..errors import ConfigError, RewardError
from .estimators import ESTIMATORS, AdvantageInputs, Advantages, EstimatorParams
from .gae import explained_variance
from ..rollout.drivers.single_turn import default_driver
from ..rollout.drivers.multi_turn import rollout_metrics
from ..rollout.drivers.result import Rollout
from ..rewards.reward_fn import call_user_code, mean_over_ranks
from ..rollout.row_seeds import RowSeeds
from ..rollout.sampling import GroupSampling, sample_groups
from ..data.example import Example
from .updates import mini_batch_plan, old_and_ref_log_probs, run_updates, summarise_updates
from .distill.reverse_kl import distill_advantages, teacher_log_probs

# Critic metrics that share a name with the actor's get this prefix in the step's record.
CRITIC_PREFIX = "vf_"
# In the record of a step skipped because none of its completions had a token to train on.
SKIPPED_EMPTY = "skipped_empty"


@dataclass
class SampledBatch:
    """One RL step's rollout, sampled and scored, ready to train on: the rows kept (after group
    filtering), the sampling metrics over every rank (``metrics``: rewards and filtering, which
    open the step's record; ``late_metrics``: the reward function's own and the rollout's, which
    follow the updates'), the ``rollout_samples`` rows, how long its generation took and the policy
    ``version`` (RL steps done when it was sampled; trainer/algos/sample_ahead.py keeps several ahead)."""

    rollout: Rollout
    metrics: dict
    late_metrics: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    gen_time_s: float = 0.0
    version: int = 0

    def to_plain(self) -> dict:
        """The batch as lists, numbers, strings and tensors (what a checkpoint's ``extra`` holds): a
        row's images as the pixel inputs its training batch is built from (the pictures were sampled
        already)."""
        rollout = dataclasses.asdict(dataclasses.replace(self.rollout, images=None))
        if self.rollout.images is not None:
            rollout["images"] = [None if ex is None or ex.pixel_values is None else
                                 {"pixel_values": ex.pixel_values, "image_grid_thw": ex.image_grid_thw}
                                 for ex in self.rollout.images]
        return {"rollout": rollout, "metrics": dict(self.metrics), "late_metrics": dict(self.late_metrics),
                "rows": list(self.rows), "gen_time_s": self.gen_time_s, "version": self.version}

    @classmethod
    def from_plain(cls, plain: dict) -> "SampledBatch":
        rollout = dict(plain["rollout"])
        if rollout.get("images") is not None:
            rollout["images"] = [None if entry is None else PixelInputs(**entry) for entry in rollout["images"]]
        return cls(Rollout(**rollout), dict(plain["metrics"]), dict(plain["late_metrics"]),
                   list(plain["rows"]), float(plain["gen_time_s"]), int(plain["version"]))


@dataclass(frozen=True)
class PixelInputs:
    """A row's pixel inputs taken back from a checkpoint (what trainer/data/batch.py reads of an Example)."""

    pixel_values: object
    image_grid_thw: object


@dataclass(frozen=True)
class StepSeeds:
    """One RL step's seeds, so a resumed run draws the same completions and updates: ``sample``
    seeds the process's generators (what else draws: dropout; the sampling too without ``rows``),
    ``rows`` each completion (trainer/rollout/row_seeds.py) and ``shuffle`` the mini-batch order."""

    sample: int
    shuffle: int = 0
    rows: RowSeeds | None = None


@dataclass(frozen=True)
class RLContext:
    """What every RL step of a phase shares. ``algo``: the AlgoSection; ``actor_loss``: its policy
    loss (``algo.actor_loss``); ``mini_batches``: optimizer steps per epoch; ``driver`` runs the
    rollout (trainer/rollout/drivers/; None: ``rollout.engine=auto``); ``sampling``: how a step
    samples (None: from ``algo.actor``, the sampler's log-probs when algo.rollout_correction reads
    them). ``ref``, ``critic``/``value_loss`` (the critic estimator's value model and loss) and
    ``teacher`` (algo.distill's frozen teacher engine) are None when the job has none.
    ``samples``: each step's first ``samples`` prompts' first completions go into its record as
    ``rollout_samples`` rows (:func:`rollout_sample_rows`)."""

    policy: object
    tokenizer: object
    algo: object
    actor_loss: object
    ref: object = None
    mini_batches: int = 1
    scorer: object = None
    driver: object = None
    sampling: GroupSampling | None = None
    critic: object = None
    value_loss: object = None
    teacher: object = None
    samples: int = 0

    def __post_init__(self) -> None:
        if self.driver is None:
            object.__setattr__(self, "driver", default_driver())
        if self.sampling is None:
            log_probs = self.algo.rollout_correction.needs_rollout_log_probs
            object.__setattr__(self, "sampling", GroupSampling.of(self.tokenizer, self.algo.actor, log_probs))


def rl_step(ctx: RLContext, examples: list[Example], seeds: StepSeeds,
            more_examples: Callable[[int], list[Example]] | None = None, train_actor: bool = True) -> dict:
    """Train one RL step on this rank's prompts ``examples``. ``more_examples(k)`` gives the
    k-th extra prompt batch for group filtering; ``train_actor=False`` trains only the critic
    (its warm-up)."""
    t0 = time.perf_counter()
    cancellation_point()  # a SIGTERM during the last evaluation stops here (engines/cancellation.py)
    # The weight sync is a phase of its own, before the step's generators are seeded: what it
    # does (vLLM's start, or nothing) cannot move what the sampling draws.
    ctx.driver.engine.update_weights(ctx.policy)
    t_sync = time.perf_counter() - t0
    batch = sample_batch(ctx, examples, seeds, more_examples)
    cancellation_point()  # the rollout is the step's longest part before the first update
    return train_batch(ctx, batch, seeds.shuffle, train_actor, timing={"weight_sync_time_s": t_sync, "started": t0})


def sample_batch(ctx: RLContext, examples: list[Example], seeds: StepSeeds,
                 more_examples: Callable[[int], list[Example]] | None = None, prefetched=None,
                 prefetch_s: float = 0.0) -> SampledBatch:
    """Sample and score one step's rollout with the driver's engine as it is (no weight sync),
    then put the engine to sleep; the arguments are :func:`rl_step`'s. ``prefetched``: the first
    round's completions, already generated (sample_ahead.py's background generation; the
    process's generators were seeded when it started), which took ``prefetch_s``. Collective."""
    t0 = time.perf_counter() - prefetch_s
    policy, driver = ctx.policy, ctx.driver
    if prefetched is None:
        policy.backend.manual_seed(seeds.sample)
    sampled = sample_groups(policy, ctx.tokenizer, examples, ctx.sampling, driver, ctx.scorer, more_examples,
                            seeds.rows, prefetched=prefetched)
    driver.engine.sleep()  # its device memory goes to the updates until the next rollout
    gen_time = time.perf_counter() - t0
    metrics = {**reward_metrics(sampled.first, policy.device), **sampled.metrics}
    late = {**mean_over_ranks(sampled.first.reward_metrics), **rollout_metrics(sampled.first.rollout_metrics)}
    rows = rollout_sample_rows(examples, sampled.first, ctx.sampling.group_size, ctx.samples) \
        if ctx.samples > 0 else []
    return SampledBatch(sampled.kept, metrics, late, rows, gen_time)


def train_batch(ctx: RLContext, batch: SampledBatch, shuffle_seed: int = 0, train_actor: bool = True,
                timing: dict | None = None) -> dict:
    """The advantages and updates of a sampled batch, and the step's record (:func:`rl_step`'s
    arguments; ``timing``: ``started`` (the step's start) and more entries for the record)."""
    timing = dict(timing or {})
    t0 = timing.pop("started", time.perf_counter())
    roll = batch.rollout
    metrics = dict(batch.metrics)
    pairs = roll.pairs()
    updates = []
    # Rows without a token to train on (empty completions: an aborted generation) are masked; a
    # step where every rank's rows are empty has nothing to train on: no update (not a crash).
    trainable = sum_over_replicas([float(sum(trainable_tokens(pair) for pair in pairs))], ctx.policy.device)[0]
    if pairs and trainable == 0:
        metrics[SKIPPED_EMPTY] = 1.0
        metrics["updates"] = 0.0
    elif pairs:
        trained, updates = train_on_rollout(ctx, roll, pairs, shuffle_seed, train_actor)
        metrics.update(trained)
    metrics.update({"tokens": float(sum(len(pair[0]) + len(pair[1]) for pair in pairs)),
                    "gen_time_s": batch.gen_time_s, **timing, "step_time_s": time.perf_counter() - t0})
    if ctx.critic is not None:
        metrics["actor_trained"] = float(train_actor)
    metrics.update(batch.late_metrics)
    if len(updates) > 1:
        metrics["update_metrics"] = updates
    if batch.rows:
        metrics["rollout_samples"] = batch.rows
    return metrics


def rollout_sample_rows(examples: list[Example], roll, n: int, count: int) -> list[list]:
    """``[prompt, completion, ground truth, reward]`` (the validation generations' columns) of
    the first completion of each of the first ``count`` prompts of a rollout with ``n`` per prompt."""
    return [[examples[i].prompt, roll.texts[i * n], examples[i].answer, roll.rewards[i * n]]
            for i in range(min(count, len(examples)))]


def train_on_rollout(ctx: RLContext, roll, pairs, shuffle_seed: int, train_actor: bool) -> tuple[dict, list[dict]]:
    """Advantages and updates of one rollout (``pairs``: its ``pairs()``): ``(summary metrics,
    per-update records)``."""
    policy, critic, ref, tokenizer, algo, actor_loss = \
        ctx.policy, ctx.critic, ctx.ref, ctx.tokenizer, ctx.algo, ctx.actor_loss
    g, est = algo.actor, algo.estimator
    device = policy.device
    pad_mode = policy.engine_config.pad_mode
    batch = build_batch(pairs, pad_mode, tokenizer.pad_token_id, images=roll.images)
    masks = [response_mask(*pair) for pair in pairs]
    token_fields: dict[str, list[torch.Tensor]] = {}
    if roll.log_probs is not None:
        token_fields["rollout_log_probs"] = [response_field(p, lp) for p, lp in zip(roll.prompt_ids, roll.log_probs)]
    kl_in_reward = algo.kl_in_reward and ref is not None
    need_old = algo.needs_old_log_probs(actor_loss, has_reference=ref is not None)
    old, ref_lp = old_and_ref_log_probs(policy, ref, batch, g.temperature, need_old, token_fields)
    # The critic runs with the policy's engine settings (one `engine` group), so the batch fits both.
    values = per_sequence(critic.infer_values(batch)["values"], batch, pad_mode) if critic is not None else None
    # Batch statistics count each replica once (its SP ranks hold the same rollout).
    over_ranks = lambda v: sum_over_replicas(v, device)  # noqa: E731
    inputs = AdvantageInputs(
        rewards=roll.rewards, masks=masks, group_size=g.group_size, old_log_probs=old, ref_log_probs=ref_lp,
        values=values, kl=[o - r for o, r in zip(old, ref_lp)] if kl_in_reward else None, kl_coef=g.kl_coef,
        params=EstimatorParams.of(algo), sum_over_ranks=over_ranks, algo=algo)
    # A built-in's failure is polyfsdp's bug (a traceback); the user's own is one line naming it.
    result = est(inputs) if algo.adv_estimator in ESTIMATORS else _user_estimator(est, inputs, algo.adv_estimator)
    if critic is not None and result.returns is None:
        raise ConfigError(f"algo.adv_estimator={algo.adv_estimator} declares needs_critic but returned no returns "
                         f"(the critic's targets): return Advantages(advantages, returns)")
    token_fields["advantages"] = result.advantages
    out: dict = {}
    if ctx.teacher is not None:
        # The teacher's pass is the reference's; the student's log-probs are the step's old ones.
        taught = teacher_log_probs(ctx.teacher, batch, g.temperature, pad_mode)
        token_fields["advantages"], distilled = distill_advantages(
            result.advantages, masks, old, taught, algo.distill.coef, algo.distill.task_weight, over_ranks)
        out.update(distilled)
    plan = trainable_plan(mini_batch_plan(len(pairs) // g.group_size, g.group_size, ctx.mini_batches, g.epochs,
                                          shuffle_seed), [trainable_tokens(pair) for pair in pairs], over_ranks)
    critic_records: list[dict] = []
    if critic is not None:
        out.update(value_metrics(values, result.returns, masks, over_ranks))
        critic_updates = run_updates(critic, pairs, {"old_values": values, "returns": result.returns}, plan,
                                     ctx.value_loss, tokenizer.pad_token_id, 1.0, images=roll.images)
        out.update(_as_critic(summarise_updates(critic_updates)))
        critic_records = [_as_critic(u) for u in critic_updates]
    actor_records: list[dict] = []
    if train_actor:
        actor_records = run_updates(policy, pairs, token_fields, plan, actor_loss, tokenizer.pad_token_id,
                                    g.temperature, images=roll.images)
        out.update(summarise_updates(actor_records))
    if critic_records and actor_records:
        return out, [{**c, **a} for c, a in zip(critic_records, actor_records)]
    return out, critic_records or actor_records


def _as_critic(metrics: dict) -> dict:
    """The critic's metrics under names that cannot clash with the actor's (its ``loss`` is
    ValueLoss' ``vf_loss`` again, so dropped)."""
    return {key if key.startswith(CRITIC_PREFIX) else CRITIC_PREFIX + key: value
            for key, value in metrics.items() if key != "loss"}


def empty_step_warning(metrics: dict, step: int) -> str | None:
    """The one line for RL step ``step``'s record when the step was skipped for its empty
    completions (:func:`train_batch`); None otherwise."""
    if not metrics.get(SKIPPED_EMPTY):
        return None
    return (f"warning: rl step {step} skipped, no update: its {int(metrics.get('empty_completions', 0))} "
            f"completion(s) hold no token to train on (empty: an aborted generation?); metrics.jsonl counts them "
            f"(empty_completions)")


def trainable_tokens(pair: tuple) -> int:
    """How many response tokens of a ``(prompt, response[, loss mask])`` row the loss reads: 0 for
    an empty completion (and for a conversation whose model turns are all masked)."""
    return int(response_mask(*pair).sum())


def trainable_plan(plan: list[list[int]], tokens: list[int], over_ranks) -> list[list[int]]:
    """The optimizer steps of ``plan`` whose rows hold a token to train on, on some rank (the
    losses normalise by that global count; a step without any would divide by 0): one
    reduction for all of them, so every rank keeps the same steps."""
    counts = over_ranks([float(sum(tokens[i] for i in indices)) for indices in plan])
    return [indices for indices, count in zip(plan, counts) if count > 0]


def reward_metrics(roll, device) -> dict:
    """Mean, std, solved fraction and response length of a rollout's completions, and how many
    are empty (no token to train on: ``empty_completions``, a count), over all ranks."""
    rewards = torch.tensor(roll.rewards, dtype=torch.float32)
    resp_len = float(sum(len(r) for r in roll.response_ids))
    solved = float(sum(r == 1.0 for r in roll.rewards))
    empty = float(sum(trainable_tokens(pair) == 0 for pair in roll.pairs()))
    reward_sum, reward_sq, count, resp_sum, solved_sum, empty_sum = all_reduce_sum(
        [float(rewards.sum()), float((rewards ** 2).sum()), float(rewards.numel()), resp_len, solved, empty], device)
    mean = reward_sum / count
    return {"reward": mean, "reward_std": max(reward_sq / count - mean ** 2, 0.0) ** 0.5,
            "solved": solved_sum / count, "response_len": resp_sum / count, "empty_completions": empty_sum}


def _user_estimator(est, inputs: AdvantageInputs, spec: str) -> Advantages:
    """The user's estimator (``path.py:NAME``) on this rollout: an exception, ``sys.exit`` or a
    result of the wrong shape is one line naming it, like a failing reward function."""
    who, where = f"algo.adv_estimator={spec}", f"(a rollout of {len(inputs.masks)} sequences)"
    result = call_user_code(lambda: est(inputs), who, where, None, "")
    if not isinstance(result, Advantages):
        raise RewardError(f"{who} returned {type(result).__name__}; return Advantages(advantages, returns=None) "
                          f"with one tensor per sequence, shaped like its mask {where}")
    if len(result.advantages) != len(inputs.masks) or any(
            not torch.is_tensor(a) or a.shape != m.shape for a, m in zip(result.advantages, inputs.masks)):
        raise RewardError(f"{who} returned advantages that are not one tensor per sequence shaped like its mask "
                          f"(expected {len(inputs.masks)}, got {len(result.advantages)}) {where}")
    # A NaN or inf here would surface as the engine's "field 'advantages' must be finite", naming
    # neither the estimator nor the sequence.
    for name, tensors in (("advantages", result.advantages), ("returns", result.returns or [])):
        for i, tensor in enumerate(tensors):
            if not torch.is_tensor(tensor) or not torch.isfinite(tensor).all():
                bad = tensor[~torch.isfinite(tensor)][0].item() if torch.is_tensor(tensor) else tensor
                raise RewardError(f"{who} returned {name} holding {bad} for sequence {i} (prompt group "
                                  f"{i // inputs.group_size}, reward {inputs.rewards[i]!r}); return finite numbers "
                                  f"{where}")
    return result


def value_metrics(values, returns, masks, over_ranks) -> dict:
    """The rollout's critic diagnostics, before its updates: explained variance of the
    returns by the values, and the mean return and value over the response tokens (all ranks)."""
    sums = [sum(float((r * m).sum()) for r, m in zip(returns, masks)),
            sum(float((v * m).sum()) for v, m in zip(values, masks)),
            sum(float(m.sum()) for m in masks)]
    returns_sum, values_sum, count = over_ranks(sums)
    count = max(count, 1.0)
    return {"vf_explained_var": explained_variance(values, returns, masks, over_ranks),
            "returns_mean": returns_sum / count, "values_mean": values_sum / count}
