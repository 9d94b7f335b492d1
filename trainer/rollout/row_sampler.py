"""Drawing each row's next token with the row's own generator (its seed: trainer/rollout/row_seeds.py),
so a completion depends on its prompt, its seed and the model only, never on which other rows
share the batch or how many rows a replica holds.

A token is drawn by the Gumbel-max rule: ``argmax(logits / T - log(-log u))`` with one uniform
``u`` per vocabulary entry from the row's generator, which samples exactly
``softmax(logits / T)``. Every row draws one vector per new token, whichever path decodes it:
our loop (trainer/rollout/decode.py, finished rows leave the batch) and HF ``generate`` through
:func:`shaping_processor` draw the same tokens from the same logits.
"""
from __future__ import annotations

import torch


class RowSampler:
    """One generator per row (on the logits' device), seeded from ``seeds``."""

    def __init__(self, seeds: list[int], device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __len__(self) -> int:
        return len(self.generators)

    def draw(self, scaled_logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Tokens (B,) for float32 logits of the sampling distribution (B, vocab; by default
        ``logits / temperature``, trainer/rollout/controls/logits_shaping.py), row ``i`` of which is
        row ``rows[i]`` of the batch the sampler was built for."""
        uniform = torch.empty_like(scaled_logits)
        for i, row in enumerate(rows):
            uniform[i].uniform_(generator=self.generators[row])
        # u = 0 gives -inf: that entry is never chosen (probability 2**-24 per entry).
        return (scaled_logits - uniform.log_().neg_().log_()).argmax(-1)


def shaping_processor(params, prompt_seen, width: int, want_log_probs: bool, seeds: list[int] | None = None,
                      device=None):
    """A HF logits processor that gives ``generate`` the step's distribution of
    trainer/rollout/controls/logits_shaping.py (``prompt_seen(vocab)``: the prompts' tokens as a (B, vocab)
    mask, for a repetition penalty; ``width``: the padded prompt length); with ``seeds`` it also
    draws each row's token with :class:`RowSampler` on ``device`` (see :class:`ShapedChoice`)."""
    from transformers import LogitsProcessor

    from .controls.logits_shaping import shape_logits

    class ShapedChoice(LogitsProcessor):
        """Each step: the rows' shaped logits, the completion's newest token counted as seen (the
        left padding never is, where HF's own repetition penalty counts pad tokens). With seeds,
        for greedy ``generate``: it draws every row's token and leaves only that token finite, so
        the argmax takes it, keeping each drawn token's log-prob (``log_probs``, per step) when
        ``want_log_probs``; without, sampling or greedy ``generate`` takes the shaped logits."""

        def __init__(self) -> None:
            self.sampler = RowSampler(seeds, device) if seeds else None
            self.rows = list(range(len(seeds or ())))
            self.log_probs: list[torch.Tensor] = []
            self.seen: torch.Tensor | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            seen = self.seen
            if prompt_seen is not None and seen is None:
                seen = self.seen = prompt_seen(scores.shape[-1])
            elif seen is not None and input_ids.shape[1] > width:
                seen[torch.arange(len(input_ids), device=seen.device), input_ids[:, -1]] = True
            shaped = shape_logits(scores, params, seen)
            if self.sampler is None:
                return shaped
            tokens = self.sampler.draw(shaped, self.rows)
            if want_log_probs:
                self.log_probs.append(torch.log_softmax(shaped, -1).gather(-1, tokens[:, None])[:, 0])
            chosen = torch.full_like(scores, float("-inf"))
            chosen.scatter_(-1, tokens[:, None], 0.0)
            return chosen

    return ShapedChoice()
