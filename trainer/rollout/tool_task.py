"""The built-in tool environment ``rollout.env=calculator`` and the built-in tool task
``data.task=calculator`` (``polyfsdp-train task=calculator``).

The environment: the model may call a calculator
(``<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>``), gets
the result as a ``tool`` message, and is rewarded 1 when the last number of its final (tool-free)
turn is the record's answer. The calculator evaluates + - * / // % ** and parentheses on
numbers, nothing else.

The task: products of two 2-digit numbers, beyond what the tiny default model computes alone;
each record carries a demonstration conversation that calls the calculator (the SFT phase
trains on it, trainer/algos/tool_sft.py).
"""
from __future__ import annotations

import ast
import json
import operator
import random

from .environments import EnvStep, Environment, parse_tool_calls
from ..rewards.rules import gsm8k
from ..data.example import Example

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
# Keeps ``9**9**9`` from taking the machine: exponents and operands past this are refused.
_LIMIT = 10 ** 12


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text, or ``error: ...``."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            result = _OPERATORS[type(node.op)](left, right)
            if abs(result) > _LIMIT:
                raise ValueError("result too large")
            return result
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


class CalculatorEnv(Environment):
    """A calculator tool; reward 1 when the final answer's last number is the record's answer
    (the ``gsm8k`` rule: ``#### N`` in a worked reference answer, else its last number)."""

    tools = [CALCULATOR_TOOL]

    def reset(self, example) -> list:
        self.answer = str(example.answer).strip()
        return super().reset(example)

    def step(self, assistant_text: str) -> EnvStep:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            return EnvStep([], gsm8k("", assistant_text, self.answer), True)
        results = []
        for call in calls:
            if call["name"] != "calculator":
                results.append(f"error: unknown tool {call['name']!r}" if call["name"] else f"error: {call['error']}")
            else:
                args = call["arguments"] if isinstance(call["arguments"], dict) else {}
                results.append(calculate(str(args.get("expression", ""))))
        return EnvStep([{"role": "tool", "content": r} for r in results], 0.0, False)


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as the assistant writes it (the format :func:`parse_tool_calls` reads), in
    compact JSON: the character-level default model samples every character of it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"


class CalculatorTask:
    """``a*b`` for 2-digit ``a`` and ``b``; the demonstration asks the calculator, then answers
    with its result."""

    name = "calculator"
    distinct_prompts = 90 * 90
    max_answer_chars = 4  # 99*99 = 9801

    def sample(self, rng: random.Random) -> Example:
        """One random product drawn with ``rng``."""
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question, answer = f"{a}*{b}", str(a * b)
        demonstration = ({"role": "user", "content": question},
                         {"role": "assistant", "content": tool_call_text("calculator", {"expression": question})},
                         {"role": "tool", "content": calculate(question)},
                         {"role": "assistant", "content": answer})
        return Example(prompt=question, answer=answer, messages=demonstration[:1], data_source=self.name,
                       where=f"calculator problem {question!r}", conversation=demonstration)
