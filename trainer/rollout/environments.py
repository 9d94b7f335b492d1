"""``rollout.env``: an environment the policy talks to for several turns (tools, games, users).

An environment is a class; polyfsdp makes one instance per trajectory (``rollout.env_kwargs``
are its keyword arguments), so per-conversation state lives on ``self``:

- ``tools``: the tools it offers, as JSON schemas for the chat template's ``tools=`` (may be empty);
- ``reset(example) -> messages``: the conversation that starts the trajectory (chat messages,
  ``{"role": ..., "content": ...}``), from the data record (an ``Example``: ``prompt``,
  ``answer``, ``messages``, ``data_source``, ``extra_info``);
- ``step(assistant_text) -> EnvStep(messages, reward, done)`` (or that tuple) after each
  assistant turn: the messages to append (tool results, the user's reply), this turn's reward
  and whether the conversation is over.

Compared with verl's agent loop, a verl tool's ``execute(instance_id, parameters)`` becomes the
body of ``step`` (after :func:`parse_tool_calls`), its ``calc_reward`` the reward of the last
step, and ``create``/``release`` the instance's life; compared with TRL's environments,
``reset``/``step`` keep their meaning, but messages replace raw text, so the chat template,
not the environment, renders turns.
"""
from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..config.plugins import load_object

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class EnvStep:
    """What an environment answers to one assistant turn."""

    messages: list = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


class Environment:
    """Base class (optional: any class with ``reset`` and ``step`` works)."""

    tools: list = []

    def reset(self, example) -> list:
        """The conversation that starts a trajectory: the example's chat messages, or its prompt
        as one user message."""
        return list(example.messages) if example.messages else [{"role": "user", "content": example.prompt}]

    def step(self, assistant_text: str) -> EnvStep:
        raise NotImplementedError


def parse_tool_calls(text: str) -> list[dict]:
    """The tool calls in ``text`` written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Qwen's and Hermes' format); a call whose body is not such JSON is returned as
    ``{"name": None, "error": ...}`` so the environment can answer it."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError as exc:
            calls.append({"name": None, "arguments": {}, "error": f"not JSON: {exc}"})
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append({"name": None, "arguments": {}, "error": "expected {\"name\": ..., \"arguments\": {...}}"})
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append({"name": call["name"], "arguments": arguments})
    return calls


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` as a list of ``{"role": str, "content": str}``; ValueError naming ``where``."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where} returned {type(messages).__name__}, expected a list of chat messages")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where} returned the message {m!r}; expected {{'role': str, 'content': str}}")
    return [dict(m) for m in messages]


def is_finite_reward(value) -> bool:
    """Whether ``value`` is a finite real number (not a bool): what a step or an agent may return."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))


def as_env_step(result, where: str) -> EnvStep:
    """An :class:`EnvStep` from what ``step`` returned (the dataclass, or (messages, reward, done))."""
    if isinstance(result, tuple) and len(result) == 3:
        result = EnvStep(*result)
    if not isinstance(result, EnvStep):
        raise ValueError(f"{where} returned {type(result).__name__}; expected EnvStep(messages, reward, done) or "
                         f"a (messages, reward, done) tuple")
    reward = result.reward
    if not is_finite_reward(reward):
        raise ValueError(f"{where} returned the reward {reward!r}; expected a finite number")
    return EnvStep(check_messages(result.messages, where), float(reward), bool(result.done))


def _builtin_environments() -> dict:
    from .tool_task import CalculatorEnv

    return {"calculator": CalculatorEnv}


def load_environment(spec: str):
    """The environment class ``rollout.env`` names (a built-in, ``file.py:Class``, ``module:Class``)."""
    env_class = load_object(spec, "rollout.env", _builtin_environments(), what="class")
    for method in ("reset", "step"):
        if not callable(getattr(env_class, method, None)):
            raise ConfigError(f"rollout.env={spec}: {getattr(env_class, '__name__', env_class)} has no {method}() "
                              f"method; an environment needs reset(example) and step(assistant_text)")
    return env_class
