"""Demonstration conversations in data files: a record's ``messages`` field.

A record of ``data.train_files`` / ``data.path`` may carry a multi-turn demonstration in chat
format (TRL's and verl's multi-turn SFT field name)::

    {"messages": [{"role": "user", "content": "17*23"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function",
                                   "function": {"name": "calculator", "arguments": {"expression": "17*23"}}}]},
                  {"role": "tool", "content": "391"},
                  {"role": "assistant", "content": "391"}]}

It becomes the record's ``Example.conversation``, which the multi-turn SFT phase trains on when
``rollout.env`` is set (trainer/algos/tool_sft.py: only the assistant turns are in the loss). The
messages before the first assistant turn are the prompt when the record has no prompt field;
the last assistant turn's text is the answer when it has no answer field.

An assistant turn's ``tool_calls`` are written into its text as the policy writes them when it
samples (``<tool_call>{json}</tool_call>`` after the content, one line each, the format
:func:`~polyfsdp.trainer.rollout.environments.parse_tool_calls` reads): SFT trains the text the rollout
samples and parses, not a template's rendering of structured calls. ``arguments`` may be an
object or a JSON string (OpenAI's format).
"""
from __future__ import annotations

import json

from ..rollout.tool_task import tool_call_text

ROLES = ("system", "user", "assistant", "tool")
# The field a record's demonstration sits in (a fixed name: the one TRL and verl use).
MESSAGES_FIELD = "messages"


class DemonstrationError(ValueError):
    """A malformed demonstration; the message names the field, the message and what is wrong."""


def plain_value(value):
    """``value`` as plain Python: pandas hands list columns over as numpy arrays."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (str, bytes)) else value


def _tool_call(call, where: str) -> str:
    """One structured tool call (``{"function": {"name", "arguments"}}`` or ``{"name", "arguments"}``) as text."""
    call = plain_value(call)
    function = plain_value(call.get("function", call)) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise DemonstrationError(f"{where} must be {{\"function\": {{\"name\": text, \"arguments\": {{...}}}}}}, "
                                 f"got {str(call)[:80]}")
    arguments = plain_value(function.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise DemonstrationError(f"{where} 'arguments' is text that is not JSON: {arguments[:80]!r}") from None
    if not isinstance(arguments, dict):
        raise DemonstrationError(f"{where} 'arguments' must be an object, got {type(arguments).__name__}")
    return tool_call_text(name, arguments)


def _message(message, where: str) -> dict:
    """``{"role", "content"}`` of one chat message, an assistant's tool calls written into its content."""
    message = plain_value(message)
    if not isinstance(message, dict):
        raise DemonstrationError(f"{where} must be an object {{\"role\": ..., \"content\": ...}}, "
                                 f"got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise DemonstrationError(f"{where} has role {role!r}; expected one of {', '.join(ROLES)}")
    content = message.get("content")
    calls = plain_value(message.get("tool_calls")) or []
    if content is None and calls:
        content = ""  # OpenAI's format: a turn that only calls tools has no content
    if isinstance(plain_value(content), list) and role in ("user", "system") and not calls:
        # Image and text parts (trainer/data/images.py checks them where the prompt is read).
        return {"role": role, "content": [plain_value(part) for part in plain_value(content)]}
    if not isinstance(content, str):
        kind = "text" if role in ("assistant", "tool") else "text or a list of image and text parts"
        raise DemonstrationError(f"{where} 'content' must be {kind}, got {type(content).__name__}")
    if calls and role != "assistant":
        raise DemonstrationError(f"{where} has 'tool_calls' but role {role!r}; only assistant turns call tools")
    if not isinstance(calls, list):
        raise DemonstrationError(f"{where} 'tool_calls' must be a list, got {type(calls).__name__}")
    texts = [content] if content else []
    texts += [_tool_call(call, f"{where} tool call {j}") for j, call in enumerate(calls)]
    return {"role": role, "content": "\n".join(texts)}


def read_conversation(value) -> tuple[dict, ...]:
    """The demonstration in a record's ``messages`` field; DemonstrationError (one line, naming
    the field and the message) when it is malformed."""
    value = plain_value(value)
    field = repr(MESSAGES_FIELD)
    if not isinstance(value, list) or not value:
        raise DemonstrationError(f"field {field} must be a non-empty list of chat messages, got {str(value)[:80]}")
    conversation = tuple(_message(m, f"field {field} message {i}") for i, m in enumerate(value))
    roles = [m["role"] for m in conversation]
    if "assistant" not in roles:
        raise DemonstrationError(f"field {field} has no assistant message: nothing to train on")
    first = roles.index("assistant")
    if first == 0:
        raise DemonstrationError(f"field {field} starts with an assistant message; the user's (or system's) "
                                 f"messages come first")
    if "tool" in roles[:first]:
        raise DemonstrationError(f"field {field} message {roles.index('tool')} is a tool result before any "
                                 f"assistant turn called a tool")
    later = next((i for i in range(first, len(conversation)) if not isinstance(conversation[i]["content"], str)), None)
    if later is not None:
        raise DemonstrationError(f"field {field} message {later} holds image parts after the first assistant turn; only "
                                 f"the prompt's messages (before it) may hold images")
    return conversation


def opening(conversation) -> tuple[dict, ...]:
    """The messages before the first assistant turn (the prompt)."""
    return tuple(conversation[:[m["role"] for m in conversation].index("assistant")])


def final_answer(conversation) -> str:
    """The last assistant turn's text (the reference answer)."""
    return next(m["content"] for m in reversed(conversation) if m["role"] == "assistant")


def unused_demonstrations_note(examples, env) -> str | None:
    """A note when records carry demonstrations but no ``rollout.env`` is set: SFT then trains
    prompt -> final answer only, which a user who wrote conversations likely did not intend."""
    # A single exchange (the prompt's messages, then one assistant answer) is what SFT trains anyway.
    if env or not any(ex.conversation and len(ex.conversation) > len(opening(ex.conversation)) + 1 for ex in examples):
        return None
    return (f"data: the records' {MESSAGES_FIELD!r} conversations are not trained on without rollout.env: SFT "
            f"trains each prompt -> its final answer; set rollout.env (and rollout.max_turns) to train the "
            f"conversations")
