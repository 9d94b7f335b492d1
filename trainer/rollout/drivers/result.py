"""What a rollout driver returns: a rollout's rows (trainer/rollout/drivers/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError


@dataclass
class Rollout:
    """Completions of a list of prompts: token lists, decoded text and rewards."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    rewards: list[float]
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)
    # The sampler's log-prob of each response token (at the sampling temperature), when asked.
    log_probs: list[list[float]] | None = None
    # Each completion's answer for majority votes (rewards.Scorer.score_with_answer), when asked.
    answers: list[str | None] | None = None
    # Multi-turn (trainer/rollout/drivers/multi_turn.py): 1 for the response tokens the policy sampled, 0 for the
    # environment's; None: every response token was sampled.
    loss_masks: list[list[int]] | None = None
    # Per-trajectory values of the rollout itself (multi-turn: turns, tool calls, truncations).
    rollout_metrics: dict[str, list[float]] = field(default_factory=dict)
    # Per row, the Example whose prompt holds images (its pixel_values/image_grid_thw; a
    # vision-language policy), or None: trainer/data/batch.py carries them into the batches.
    images: list | None = None

    def pairs(self) -> list[tuple]:
        """(prompt, response) per row, with the row's loss mask as a third item when there is one
        (what trainer/data/batch.py builds batches from)."""
        if self.loss_masks is None:
            return list(zip(self.prompt_ids, self.response_ids))
        return list(zip(self.prompt_ids, self.response_ids, self.loss_masks))


def refuse_images(examples, key: str, name: str) -> None:
    """A one-line ConfigError naming the first of ``examples`` whose prompt holds images: the
    conversations of ``key`` (``rollout.env`` or ``rollout.agent``) ``name`` are text, so the policy
    would be trained on them without ever seeing the images."""
    held = next((ex for ex in examples if getattr(ex, "images", None)), None)
    if held is not None:
        raise ConfigError(f"{key}={name}: {held.where or 'a record'} holds images, and multi-turn conversations are "
                          f"text only (the images would be dropped); train prompts with images without {key}, "
                          f"single-turn (docs/vision-language.md)")
