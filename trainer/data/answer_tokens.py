"""The tokens single-turn SFT trains an answer as: what the model will be asked to sample after
its prompt, through the token that ends it.

A prompt the chat template wrote (chat messages, or a string with ``data.apply_chat_template``)
is followed by the answer as the template writes an assistant turn: the conversation (prompt +
the answer as an assistant message) is rendered and the tokens after the prompt's are taken,
through the template's end-of-turn token (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``;
:func:`~polyfsdp.trainer.data.chat.end_of_turn_token_id`, else ``<eos>``). What the template writes
after that token (ChatML's newline) is not trained: it is not sampled, the sampler stops at the
end-of-turn token. These are the tokens TRL's assistant-only loss trains (an assistant turn
through its end-of-turn). Anything the template writes around the answer (a ``trim``, an empty
``<think></think>``) is trained as written, so SFT teaches what the template shows the model.

A plain-text prompt (``<bos>`` + text) is followed by the answer's tokens and ``<eos>``; so is a
templated one whose template does not close the turn with a token, or whose rendering of the
whole conversation does not start with the prompt's own tokens (a template that renders the
generation prompt differently from a finished turn): there is no answer the template writes
after that prompt.
"""
from __future__ import annotations

from .chat import end_of_turn_token_id
from .example import Example


def templated_answer_tokens(tokenizer, messages, answer: str) -> list[int] | None:
    """The tokens the chat template writes for ``answer`` as the assistant's reply to
    ``messages``, through its end-of-turn token; None when it writes no such token or the full
    rendering does not extend the prompt's (see the module doc)."""
    turn_end = end_of_turn_token_id(tokenizer)
    end = turn_end if turn_end is not None else tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}],
                                         add_generation_prompt=False)
    if full[:len(prompt)] != prompt or end not in full[len(prompt):]:
        return None
    after = full[len(prompt):]
    return after[:after.index(end) + 1]


def answer_tokens(tokenizer, example: Example, chat_template: bool = False) -> list[int]:
    """The tokens SFT trains ``example``'s answer as (see the module doc); ``chat_template``:
    ``data.apply_chat_template`` (a string prompt rendered as one user message)."""
    messages = example.messages
    if messages is None and chat_template:
        messages = ({"role": "user", "content": example.prompt},)
    if messages is not None and getattr(tokenizer, "has_chat_template", False):
        written = templated_answer_tokens(tokenizer, messages, example.answer)
        if written is not None:
            return written
    return tokenizer.encode(example.answer) + [tokenizer.eos_token_id]
