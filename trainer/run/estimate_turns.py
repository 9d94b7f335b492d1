"""Sequence lengths of a multi-turn job (``rollout.env``) for ``--estimate`` (trainer/run/estimate.py).

- SFT trains each record on its demonstration conversation, so its sequences are measured, not
  bounded: they are the sequences trainer/algos/tool_sft.py builds, through the job's environment (its
  ``reset`` and tools) and chat template.
- A conversation the rollout (or the held-out evaluation) samples is bounded by its prompt,
  ``rollout.max_turns`` turns of ``algo.actor.max_new_tokens`` and the environment's turns
  between them, and capped by the total token budget (``rollout.max_total_tokens``, default the
  model's ``max_position_embeddings``), which trainer/rollout/drivers/multi_turn.py enforces. An
  environment turn is counted at the longest one in the records' demonstrations; without
  demonstrations its length cannot be known before the run, and the cap alone bounds the conversation.
- ``rollout.agent``: the agent writes each conversation's prompt and turns, so none is known before
  the run; the cap bounds each sampled conversation, and SFT trains on prompt -> answer pairs
  (trainer/algos/sft.py), counted as in a single-turn job.
"""
from __future__ import annotations

from ..rollout.build import multi_turn_driver
from ..rollout.engines import RolloutEngine
from ..algos.tool_sft import conversation_sequences


class _NoEngine(RolloutEngine):
    """The engine under the multi-turn driver: the estimate starts conversations, never samples."""

    name = "estimate"


def _longest_unmasked_run(mask: list[int]) -> int:
    """The longest run of ``loss_mask = 0`` tokens (an environment turn with its template tokens)."""
    longest = run = 0
    for m in mask:
        run = 0 if m else run + 1
        longest = max(longest, run)
    return longest


class TurnLengths:
    """The multi-turn job's sequence lengths: SFT conversations measured, sampled ones bounded."""

    def __init__(self, cfg, tokenizer, demonstrated: list, max_positions: int | None, new_tokens: int) -> None:
        self.tokenizer, self.new, self.turns, self.agent = tokenizer, new_tokens, cfg.rollout.max_turns, cfg.rollout.agent
        # SFT on conversations through the environment (an agent's SFT is prompt -> answer).
        self.conversational_sft = self.agent is None
        if self.agent is not None:
            self.rollout, self.cap, self.env_turn = None, cfg.rollout.max_total_tokens or max_positions, None
            return
        self.rollout = multi_turn_driver(cfg.rollout, _NoEngine(), max_positions)
        self.cap = self.rollout.max_total
        with_conversation = [ex for ex in demonstrated if ex.conversation]
        self.env_turn = max((_longest_unmasked_run(mask) for _, _, mask in self.sft(with_conversation, full=True)),
                            default=None) if with_conversation else None

    def sft(self, examples: list, full: bool = False):
        """The SFT sequence lengths of ``examples`` (``full``: the ``(prompt, response, mask)`` triples)."""
        sequences = conversation_sequences(self.rollout, self.tokenizer, examples) if examples else []
        return sequences if full else [len(p) + len(r) for p, r, _ in sequences]

    def conversation(self, prompt: int) -> int:
        """The most tokens a sampled conversation from a ``prompt``-token prompt can hold."""
        if self.env_turn is None:
            return self.cap if self.cap is not None else prompt + self.turns * self.new
        bound = prompt + self.turns * self.new + (self.turns - 1) * self.env_turn
        return min(bound, self.cap) if self.cap is not None else bound

    def note(self) -> str:
        cap = f"capped at {self.cap} tokens (rollout.max_total_tokens, default max_position_embeddings)" \
            if self.cap is not None else "no total token budget known"
        if self.agent is not None:
            bound = f"counted at that cap, {self.cap} tokens (rollout.max_total_tokens, default the model's " \
                    f"max_position_embeddings)" if self.cap is not None else \
                (f"counted at the data's prompt + rollout.max_turns={self.turns} x algo.actor.max_new_tokens="
                 f"{self.new}, without the agent's own turns (no total token budget known: set "
                 f"rollout.max_total_tokens for a bound)")
            return (f"rollout.agent={self.agent}: the agent writes each conversation's prompt and turns, unknown "
                    f"before the run; a sampled conversation is {bound}")
        if self.env_turn is None:
            turns = ("environment turns of unknown length (no demonstrations to measure them): the cap bounds each "
                     "conversation" if self.cap is not None else
                     "environment turns not counted (no demonstrations to measure them)")
        else:
            turns = f"{self.turns - 1} environment turn(s) of at most {self.env_turn} tokens (the demonstrations' longest)"
        return (f"rollout.env={self.rollout.settings.env}: SFT sequences are the demonstrations' conversations; a "
                f"sampled conversation is counted at its prompt + rollout.max_turns={self.turns} x "
                f"algo.actor.max_new_tokens={self.new} + {turns}, {cap}")
