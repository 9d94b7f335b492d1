"""Stop strings: a completion ends once one of ``SamplingParams.stop`` occurs in its decoded
text (``SamplingParams.detokenize``, the tokenizer's ``decode``: the text the reward sees). It
keeps its tokens up to and including the one that completed the string, the string itself
stays in the text: vLLM's rule for token ids (its ``include_stop_str_in_output`` only changes
the text; verl and TRL take vLLM's output as is), so a trainer's loss covers exactly the tokens
sampled. Our decoding loop stops a row there; engines that sample without a tokenizer (vLLM,
rollout servers: token ids in and out) generate on, and :func:`cut_completions` cuts their
completions at the same token, which leaves what was drawn before it unchanged (each row
draws with its own generator)."""
from __future__ import annotations


class StopStrings:
    """The stop strings of one SamplingParams (empty when it has none)."""

    def __init__(self, params) -> None:
        self.stops = tuple(params.stop)
        self.detokenize = params.detokenize
        if self.stops and self.detokenize is None:
            raise ValueError("SamplingParams.stop needs SamplingParams.detokenize (SamplingParams.for_tokenizer "
                             "sets it) to find stop strings in the decoded text")

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, tokens: list[int]) -> bool:
        """Whether a stop string occurs in the text of ``tokens``."""
        text = self.detokenize(list(tokens))
        return any(s in text for s in self.stops)

    def end(self, tokens: list[int]) -> int | None:
        """How many of ``tokens`` to keep: up to the first prefix whose text holds a stop
        string (what stopping after each token keeps); None when none occurs."""
        if not self.stops or not self.hit(tokens):
            return None
        return next(k for k in range(1, len(tokens) + 1) if self.hit(tokens[:k]))


def cut_completions(token_ids: list[list[int]], log_probs: list[list[float]] | None, params):
    """``(token_ids, log_probs)`` with every completion cut after its first stop string."""
    stops = StopStrings(params)
    if not stops:
        return token_ids, log_probs
    ends = [stops.end(row) for row in token_ids]
    cut = lambda rows: [row if end is None else row[:end] for row, end in zip(rows, ends)]  # noqa: E731
    return cut(token_ids), (None if log_probs is None else cut(log_probs))
