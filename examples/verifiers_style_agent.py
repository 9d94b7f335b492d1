"""A verifiers-shaped environment trained as a polyfsdp agent:
``polyfsdp-train task=calculator rollout.env=null rollout.agent=examples/verifiers_style_agent.py:agent``.

verifiers (github.com/PrimeIntellect-ai/verifiers) writes a multi-turn environment as a
``MultiTurnEnv``: its rollout asks the model (an OpenAI client) for a reply, appends it, stops
when ``is_completed(messages, state)`` (or at ``max_turns``), else appends
``env_response(messages, state)``; a ``Rubric`` then scores the conversation with weighted
reward functions. ``agent`` below is that loop over the client polyfsdp hands it, so porting a
verifiers environment means pasting its ``env_response``, ``is_completed`` and reward functions
into this shape. polyfsdp records the sampled tokens exactly; the environment's messages are
masked out of the loss.
"""
import json
import re

from polyfsdp.trainer.rollout.tool_task import CALCULATOR_TOOL, calculate


class CalculatorEnv:
    """The shape of a verifiers MultiTurnEnv: tools, max_turns, is_completed, env_response."""

    oai_tools = [CALCULATOR_TOOL]
    max_turns = 4

    def initial_messages(self, example) -> list[dict]:
        return list(example.messages or [{"role": "user", "content": example.prompt}])

    def is_completed(self, messages: list[dict], state: dict) -> bool:
        return not messages[-1].get("tool_calls")

    def env_response(self, messages: list[dict], state: dict) -> list[dict]:
        out = []
        for call in messages[-1]["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"] or "{}")
            out.append({"role": "tool", "tool_call_id": call["id"],
                        "content": calculate(str(arguments.get("expression", "")))})
        return out


def correct_answer(completion: list[dict], answer: str, **kwargs) -> float:
    """A verifiers reward function: 1 when the last number of the final message is the answer."""
    numbers = re.findall(r"-?\d+", completion[-1].get("content") or "")
    return float(bool(numbers) and numbers[-1] == answer)


RUBRIC = [(correct_answer, 1.0)]  # (reward function, weight), as verifiers.Rubric(funcs, weights)
ENV = CalculatorEnv()


def agent(example, client):
    """verifiers' MultiTurnEnv rollout loop, over the OpenAI client polyfsdp hands it."""
    state = {"answer": str(example.answer).split("####")[-1].strip(), "turn": 0}
    messages = ENV.initial_messages(example)
    prompt_length = len(messages)
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=ENV.oai_tools)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        state["turn"] += 1
        if ENV.is_completed(messages, state) or state["turn"] >= ENV.max_turns:
            break
        messages += ENV.env_response(messages, state)
    completion = messages[prompt_length:]
    return {"reward": sum(weight * fn(completion, state["answer"]) for fn, weight in RUBRIC)}
