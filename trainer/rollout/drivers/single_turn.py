"""The single-turn rollout driver (trainer/rollout/drivers/__init__.py): each row is one
completion of its example's prompt, scored by the run's reward function."""
from __future__ import annotations

from ...data.chat import example_prompt_tokens
from ...data.example import Example
from ...errors import ConfigError
from ...rank_errors import on_every_rank
from ..engines import Completions, PolicyDecoding, RolloutEngine, SamplingParams
from .result import Rollout


def default_scorer():
    """The built-in ``char_match`` reward (a driver's scorer when none is given)."""
    from ...rewards.reward_fn import Scorer, load_reward_fn

    return Scorer(load_reward_fn("char_match"), "char_match")


class SingleTurnDriver:
    """One completion per row: the example's prompt tokens through ``engine``, then the scorer."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine, self.name = engine, engine.name

    @staticmethod
    def prompts(tokenizer, examples: list[Example], n: int) -> list[list[int]]:
        """The token prompts :meth:`rollout` sends the engine: each example's, ``n`` times."""
        return [example_prompt_tokens(tokenizer, ex) for ex in examples for _ in range(n)]

    def _refuse_images(self, images) -> None:
        if images is not None:
            raise ConfigError(f"rollout.engine={self.name}: this engine takes no images; prompts with images are "
                              f"sampled by rollout.engine=builtin, hf, auto, vllm or vllm_server (docs/vision-language.md)")

    @staticmethod
    def row_images(examples: list[Example], n: int) -> list[Example] | None:
        """What :meth:`rollout` hands the engine as ``images=``: each example ``n`` times (its images
        ride on it), or None when no example holds an image."""
        rows = [ex for ex in examples for _ in range(n)]
        return rows if any(ex.pixel_values is not None for ex in rows) else None

    def rollout(self, tokenizer, examples: list[Example], n: int, params: SamplingParams, scorer=None,
                with_answers: bool = False, row_seeds: list[int] | None = None, device=None,
                prefetched: Completions | None = None) -> Rollout:
        """``n`` completions per example scored by ``scorer`` (a rewards.Scorer; default
        :func:`default_scorer`); ``with_answers``: each completion's answer for majority votes;
        ``prefetched``: the engine's completions of :meth:`prompts`, generated already."""
        prompts = self.prompts(tokenizer, examples, n)
        images = self.row_images(examples, n)
        if not getattr(self.engine, "takes_images", False):  # the same on every rank: so is entering the check
            on_every_rank(lambda: self._refuse_images(images))
        if prefetched is not None:
            out = prefetched
        elif images is not None:
            out = self.engine.generate(prompts, params, row_seeds, images=images)
        else:
            out = self.engine.generate(prompts, params, row_seeds)
        if len(out.token_ids) != len(prompts):
            raise RuntimeError(f"{self.name}: {len(out.token_ids)} completions for {len(prompts)} prompts")
        responses = out.token_ids
        texts = [tokenizer.decode(r) for r in responses]
        # A reward that raises on this rank's records must stop every rank (the next step is a collective).
        answers = [] if with_answers else None
        rewards, extras = on_every_rank(lambda: (scorer or default_scorer()).score_all(examples, texts, responses,
                                                                                        group=n, answers=answers))
        return Rollout(prompts, responses, texts, rewards, extras, out.log_probs if params.return_log_probs else None,
                       answers, images=images)


def default_driver() -> SingleTurnDriver:
    """What a rollout runs through when the caller names no driver: ``rollout.engine=auto``."""
    return SingleTurnDriver(PolicyDecoding())
