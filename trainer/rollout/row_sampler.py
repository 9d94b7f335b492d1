"""Drawing each row's next token with the row's own generator (its seed: trainer/rollout/row_seeds.py),
so a completion depends on its prompt, its seed and the model only, never on which other rows
share the batch or how many rows a replica holds.

A token is drawn by the Gumbel-max rule: ``argmax(logits / T - log(-log u))`` with one uniform
``u`` per vocabulary entry from the row's generator, which samples exactly
``softmax(logits / T)``. Every row draws one vector per new token, whichever path decodes it:
our loop (trainer/rollout/decode.py, finished rows leave the batch) and HF ``generate`` through
:class:`RowSeededChoice` draw the same tokens from the same logits.
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
        """Tokens (B,) for float32 ``logits / temperature`` (B, vocab), row ``i`` of which is
        row ``rows[i]`` of the batch the sampler was built for."""
        uniform = torch.empty_like(scaled_logits)
        for i, row in enumerate(rows):
            uniform[i].uniform_(generator=self.generators[row])
        # u = 0 gives -inf: that entry is never chosen (probability 2**-24 per entry).
        return (scaled_logits - uniform.log_().neg_().log_()).argmax(-1)


def row_seeded_processor(seeds: list[int], device, temperature: float, want_log_probs: bool):
    """A HF logits processor that samples with per-row generators (see :class:`RowSeededChoice`)."""
    from transformers import LogitsProcessor

    class RowSeededChoice(LogitsProcessor):
        """For greedy ``generate``: each step it draws every row's token with :class:`RowSampler`
        and leaves only that token finite, so the argmax takes it; with ``want_log_probs`` it
        keeps each drawn token's log-prob under ``softmax(logits / T)`` (``log_probs``, per step)."""

        def __init__(self) -> None:
            self.sampler = RowSampler(seeds, device)
            self.rows = list(range(len(seeds)))
            self.log_probs: list[torch.Tensor] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            scaled = scores.float() / temperature
            tokens = self.sampler.draw(scaled, self.rows)
            if want_log_probs:
                self.log_probs.append(torch.log_softmax(scaled, -1).gather(-1, tokens[:, None])[:, 0])
            chosen = torch.full_like(scores, float("-inf"))
            chosen.scatter_(-1, tokens[:, None], 0.0)
            return chosen

    return RowSeededChoice()
