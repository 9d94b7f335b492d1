"""Multi-turn SFT: demonstration conversations tokenized exactly as the rollout tokenizes them.

With ``rollout.env`` set, the SFT phase trains each record on a conversation instead of
prompt -> answer. It starts where a rollout starts (``MultiTurnDriver.start``: the
environment's ``reset(example)`` rendered by the chat template with the environment's tools);
each assistant turn is its text's tokens and the token that ends a turn (the chat template's
end-of-turn token, e.g. ChatML's ``<|im_end|>``, else ``<eos>``: where the sampler stops) with
``loss_mask = 1``; the tool or user messages between two assistant turns are
``ChatTurns.after_assistant``'s tokens with ``loss_mask = 0``. A rollout that samples the same
texts from the same environment therefore holds the same tokens and masks, and only the
assistant's tokens are trained.

The demonstration is the record's ``conversation`` (its turns from the first assistant message
on; its own opening messages give way to the environment's ``reset``) when it has at most
``rollout.max_turns`` assistant turns, else the record's answer as one assistant turn: with
``rollout.max_turns=1`` no tool call could be answered, so the model learns to answer directly.
"""
from __future__ import annotations

from ..data.chat import end_of_turn_token_id
from ..rank_errors import on_every_rank


def demonstration(example, max_turns: int) -> list[dict]:
    """The messages after the opening that SFT trains ``example`` on (see the module doc)."""
    conversation = list(example.conversation or ())
    first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first is not None:
        turns = conversation[first:]
        while turns[-1]["role"] != "assistant":
            turns.pop()  # messages after the last assistant turn: nobody answers them
        if sum(m["role"] == "assistant" for m in turns) <= max_turns:
            return turns
    return [{"role": "assistant", "content": example.answer}]


def conversation_sequences(rollout, tokenizer, examples) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt, response, loss_mask)`` per example for ``batch.build_batch``, through the
    multi-turn driver ``rollout`` (trainer/rollout/drivers/multi_turn.py) the RL phase samples with."""
    trajectories = on_every_rank(lambda: rollout.start(examples, 1, tokenizer))
    # The template's end-of-turn token (ChatTurns closes the turn after it), else eos.
    turn_end = end_of_turn_token_id(tokenizer)
    eos = turn_end if turn_end is not None else tokenizer.eos_token_id
    for t in trajectories:
        between: list[dict] = []
        for message in demonstration(t.example, rollout.settings.max_turns):
            if message["role"] != "assistant":
                between.append(message)
                continue
            if t.tokens:  # not the first turn: what the environment said, then the generation prompt
                t.add(t.render.after_assistant(between, ended_with_eos=True), sampled=False)
            t.add(tokenizer.encode(message["content"]) + [eos], sampled=True)
            between = []
    return [(t.prompt, t.tokens, t.loss_mask) for t in trajectories]
