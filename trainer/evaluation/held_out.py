"""Held-out evaluation: ``eval.n_samples`` completions per prompt (greedy, or sampled at
``eval.temperature``), scored by the run's reward function, summarised over every rank
(trainer/evaluation/metrics.py), with the first prompts' completions kept as a table
(``trainer.log_val_generations``). The trainer and ``polyfsdp-eval`` both call :func:`evaluate`."""
from __future__ import annotations

from dataclasses import dataclass, field

from polyfsdp.backends.distributed import all_gather_object, current_rank, current_world_size
from polyfsdp.engines.cancellation import cancellation_point

from .metrics import PromptSamples, evaluation_metrics
from ..rollout.drivers.single_turn import default_driver
from ..rollout.engines import SamplingParams
from ..rollout.row_seeds import eval_row_seeds
from ..data.example import Example

GENERATION_COLUMNS = ["prompt", "completion", "ground_truth", "reward"]
# Completions per generate call; several samples per prompt share it.
COMPLETIONS_PER_CALL = 256


@dataclass
class EvalSettings:
    """How to evaluate: ``n_samples`` per prompt at ``temperature`` (0: greedy, then one
    sample), a sample is correct for pass@k when its reward >= ``pass_threshold``; ``seed``
    seeds the sampling; ``rows``: how many prompts' first completions to keep."""

    n_samples: int = 1
    temperature: float = 0.0
    pass_threshold: float = 1.0
    seed: int = 0
    rows: int = 0
    sampling: dict = field(default_factory=dict)  # top_p, top_k, repetition_penalty, stop (SamplingParams')

    @classmethod
    def of(cls, section, seed: int, rows: int) -> "EvalSettings":
        """The settings of the job's ``eval`` section (trainer/config/sections.py: EvalSection)."""
        return cls(section.n_samples, section.temperature, section.pass_threshold, seed=seed, rows=rows,
                   sampling=section.sampling_options())

    def describe(self) -> str:
        return "greedy" if self.temperature == 0 else f"{self.n_samples} sample(s) at temperature {self.temperature:g}"


@dataclass
class EvalResult:
    reward: float                 # the mean reward over every sample (mean@n)
    metrics: dict[str, float]     # reward/<key> of the reward function, mean@n, pass@k, maj@n, per data source
    rows: list[list] = field(default_factory=list)  # [prompt, completion, ground truth, reward] rows


def evaluate(engine, tokenizer, examples: list[Example], max_new_tokens: int, scorer, settings: EvalSettings,
             driver=None) -> EvalResult:
    """Evaluate ``engine`` on ``examples`` (each rank takes every world-th one) through the rollout
    ``driver`` (trainer/rollout/drivers/; default ``rollout.engine=auto``); every rank gets the
    same result."""
    from ..rewards.reward_fn import mean_over_ranks

    rank, world, n = current_rank(), current_world_size(), settings.n_samples
    sampled = settings.temperature > 0
    driver = driver or default_driver()
    driver.engine.update_weights(engine)  # the weight sync, before the sampling is seeded
    if sampled:
        # Each row samples with its own seed (its example's index: the same on any world size);
        # the process generators are seeded for what else draws: a function of the step.
        engine.backend.manual_seed(settings.seed * 1024 + rank)
    mine = list(range(rank, len(examples), world))
    per_call = max(1, COMPLETIONS_PER_CALL // n)
    # Every rank runs the same number of generate calls, as synced generation needs.
    calls = max(1, -(-len(examples) // (world * per_call)))
    params = SamplingParams.for_tokenizer(tokenizer, max_new_tokens, greedy=not sampled,
                                          temperature=settings.temperature if sampled else 1.0, **settings.sampling)
    prompts, extras = [], {}
    for c in range(calls):
        cancellation_point()  # a SIGTERM stops an evaluation between its calls (engines/cancellation.py)
        indices = mine[c * per_call:(c + 1) * per_call]
        chosen = indices or [mine[0]]
        part = [examples[i] for i in chosen]
        result = driver.rollout(tokenizer, part, n, params, scorer=scorer, with_answers=True,
                                row_seeds=eval_row_seeds(settings.seed, chosen, n) if sampled else None,
                                device=engine.device)
        for j, index in enumerate(indices):
            rows = slice(j * n, (j + 1) * n)
            prompts.append((PromptSamples(index, examples[index].data_source, result.rewards[rows],
                                          result.answers[rows]),
                            result.texts[j * n] if index < settings.rows else None))
        if indices:
            for key, values in result.reward_metrics.items():
                extras.setdefault(key, []).extend(values)
    driver.engine.sleep()  # its device memory goes back to training
    if world > 1:
        prompts = [p for part in all_gather_object(prompts) for p in part]
    prompts.sort(key=lambda p: p[0].index)
    metrics = evaluation_metrics([p for p, _ in prompts], settings.pass_threshold)
    reward = metrics.pop("reward")
    table = [[examples[p.index].prompt, text, examples[p.index].answer, p.rewards[0]]
             for p, text in prompts if text is not None]
    return EvalResult(reward, {**mean_over_ranks(extras), **metrics}, table)
