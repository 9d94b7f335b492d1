"""The warning for an RL phase whose first rollout was sampled from a near-uniform distribution.

Its completions score by chance, the group-normalised advantages are noise, and the updates walk
the model away from what the SFT warm-up taught (measured: a LoRA warm-up of a from-scratch
preset; docs/algorithms.md, "Tuning RL on your own task").
"""
from __future__ import annotations

import math

# The share of ln(vocabulary) (the uniform distribution's entropy) from which a rollout counts as
# sampled at random.
FLAT_ENTROPY_SHARE = 0.9


def flat_sampling_warning(entropy: float | None, vocab: int, sft_steps: int) -> str | None:
    """The one-line warning when the mean ``entropy`` of a rollout over a ``vocab``-token
    vocabulary is at least FLAT_ENTROPY_SHARE of ln(vocab); None otherwise."""
    if entropy is None or vocab < 2 or entropy < FLAT_ENTROPY_SHARE * math.log(vocab):
        return None
    if sft_steps > 0:
        harm = "RL may undo the SFT warm-up"
        fix = ("train the warm-up longer (trainer.sft_steps, algo.sft.optim.lr; with LoRA the adapters cannot "
               "sharpen a from-scratch model much)")
    else:
        harm, fix = "RL learns slowly from it", "start from a trained model or add an SFT warm-up (trainer.sft_steps)"
    return (f"warning: the first RL rollout was sampled at entropy {entropy:.2f}, near uniform over "
            f"{vocab} tokens ({math.log(vocab):.2f}): its rewards are chance and {harm}; {fix} "
            f"or lower algo.actor.temperature")
