"""One record of the job's data: a prompt, its reference answer, and what travels with them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One prompt and its reference answer. ``messages`` holds a chat-format prompt (``prompt``
    is then its text, for messages and coverage checks); ``prompt_ids`` the prompt's tokens
    once encoded; ``data_source``/``extra_info`` go to the reward; ``where`` names the record;
    ``conversation`` is a multi-turn demonstration (the prompt's messages, then assistant and
    tool/user turns) that SFT trains on when the rollout runs an environment (trainer/algos/tool_sft.py).
    ``images`` are the record's decoded PIL images (trainer/data/images.py); once the prompt is
    encoded, ``pixel_values`` ``(P, D)`` and ``image_grid_thw`` ``(I, 3)`` hold what the model's
    processor made of them, and ``prompt_ids`` their image tokens (trainer/data/vision.py)."""

    prompt: str
    answer: str
    messages: tuple | None = None
    prompt_ids: tuple | None = None
    data_source: str = ""
    extra_info: dict | None = None
    where: str = ""
    conversation: tuple | None = None
    # Compared by the record, not by value: tensors have no single truth value.
    images: tuple = field(default=(), compare=False)
    pixel_values: object = field(default=None, compare=False)
    image_grid_thw: object = field(default=None, compare=False)
