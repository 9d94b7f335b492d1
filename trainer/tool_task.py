"""The built-in tool environment ``rollout.env=calculator``: the model may call a calculator
(``<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>``), gets
the result as a ``tool`` message, and is rewarded 1 when its final (tool-free) turn holds the
record's answer. The calculator evaluates + - * / // % ** and parentheses on numbers, nothing else."""
from __future__ import annotations

import ast
import operator

from .environments import EnvStep, Environment, parse_tool_calls

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
    """A calculator tool; reward 1 when the final answer contains the record's answer."""

    tools = [CALCULATOR_TOOL]

    def reset(self, example) -> list:
        self.answer = str(example.answer).strip()
        return super().reset(example)

    def step(self, assistant_text: str) -> EnvStep:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            solved = bool(self.answer) and self.answer in assistant_text
            return EnvStep([], 1.0 if solved else 0.0, True)
        results = []
        for call in calls:
            if call["name"] != "calculator":
                results.append(f"error: unknown tool {call['name']!r}" if call["name"] else f"error: {call['error']}")
            else:
                args = call["arguments"] if isinstance(call["arguments"], dict) else {}
                results.append(calculate(str(args.get("expression", ""))))
        return EnvStep([{"role": "tool", "content": r} for r in results], 0.0, False)
