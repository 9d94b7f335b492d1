"""Agents for rollout.agent (tests/cpu/trainer/rollout/test_agent_endpoint.py), written against the openai client
as a user would: each is fn(example, client) -> reward."""
import json
import time

from polyfsdp.trainer.rewards.rules import gsm8k
from polyfsdp.trainer.rollout.tool_task import CALCULATOR_TOOL, calculate


def _tool_results(message):
    results = []
    for call in message.tool_calls:
        if call.function.name != "calculator":
            content = f"error: unknown tool {call.function.name!r}"
        else:
            args = json.loads(call.function.arguments or "{}")
            content = calculate(str(args.get("expression", "")) if isinstance(args, dict) else "")
        results.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return results


def calculator(example, client):
    """The calculator task's conversation (tool_task.CalculatorEnv) as an OpenAI tool-calling agent."""
    messages = [{"role": "user", "content": example.prompt}]
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL],
                                               temperature=0.3, max_tokens=5, seed=1)  # ignored: the trainer's win
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return {"reward": gsm8k("", message.content or "", str(example.answer).strip())}
        messages += _tool_results(message)


async def calculator_async(example, client):
    """The same agent with openai.AsyncOpenAI."""
    messages = [{"role": "user", "content": example.prompt}]
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return gsm8k("", message.content or "", str(example.answer).strip())
        messages += _tool_results(message)


def guess(example, client, edit=False):
    """tests/helpers/envs/guess_env.py's GuessEnv (target "e") as an agent; ``edit``: it strips its
    history's assistant turns and adds a full stop (a re-tokenization trap)."""
    messages = [{"role": "user", "content": "guess a letter"}]
    while True:
        text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        letter = text.strip()[:1]
        if letter == "e":
            return 1.0
        messages += [{"role": "assistant", "content": text.strip() + "." if edit else text},
                     {"role": "user", "content": "higher" if letter < "e" else "lower"}]


def guess_streamed(example, client):
    """guess, reading every answer as a stream (as agent frameworks that always stream do)."""
    messages = [{"role": "user", "content": "guess a letter"}]
    while True:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(model="policy", messages=messages, stream=True)
                       if chunk.choices)
        letter = text.strip()[:1]
        if letter == "e":
            return 1.0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "higher" if letter < "e"
                                                              else "lower"}]


async def calculator_streamed(example, client):
    """calculator_async, streamed: tool calls are gathered from the deltas."""
    messages = [{"role": "user", "content": example.prompt}]
    while True:
        content, calls = "", {}
        async for chunk in await client.chat.completions.create(model="policy", messages=messages,
                                                                tools=[CALCULATOR_TOOL], stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                calls.setdefault(call.index, call)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [calls[i].model_dump(exclude_none=True, exclude={"index"}) for i in sorted(calls)]
        messages.append(message)
        if not calls:
            return gsm8k("", content, str(example.answer).strip())
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"] or "{}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(str(args["expression"]))})


def guess_text_streamed(example, client):
    """guess_text, streamed."""
    text = "guess a letter: "
    while True:
        completion = "".join(c.choices[0].text for c in client.completions.create(model="p", prompt=text, stream=True)
                             if c.choices)
        letter = completion.strip()[:1]
        if letter == "e":
            return 1.0
        text += completion + (" higher: " if letter < "e" else " lower: ")


def guess_reporting(example, client):
    """guess, returning a dict: its reward, the turns it took, and a note (not a number: left out)."""
    turns, messages = 0, [{"role": "user", "content": "guess a letter"}]
    while True:
        text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        turns += 1
        if text.strip()[:1] == "e":
            return {"reward": 1.0, "turns_taken": turns, "note": "found it", "flag": True}
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]


NOTES = {}  # what the endpoint answered guess_noting's last request, by record


def guess_noting(example, client):
    """guess, keeping the error the endpoint answers when polyfsdp ends the conversation."""
    import openai

    try:
        return guess(example, client)
    except openai.BadRequestError as exc:
        NOTES[example.where] = str(exc)
        raise


def guess_editing(example, client):
    return guess(example, client, edit=True)


def guess_text(example, client, edit=False):
    """GuessEnv over /v1/completions: the text so far and each completion, then " higher: " or
    " lower: "; ``edit``: it rewrites each completion as its letter and a full stop."""
    text = "guess a letter: "
    while True:
        completion = client.completions.create(model="policy", prompt=text, max_tokens=3).choices[0].text
        letter = completion.strip()[:1]
        if letter == "e":
            return 1.0
        text += (letter + ".") if edit else completion
        text += " higher: " if letter < "e" else " lower: "


def guess_text_editing(example, client):
    return guess_text(example, client, edit=True)


def switches_kind(example, client):
    client.completions.create(model="policy", prompt="x")
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    return 0.0


def token_prompt(example, client):
    client.completions.create(model="policy", prompt=[5, 6, 7])
    return 0.0


def raises(example, client):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    raise KeyError("boom")


def hangs(example, client):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    time.sleep(60)  # far past the test's rollout.env_timeout_s (a daemon thread: nothing waits for it)
    return 0.0


def never_calls(example, client):
    return 1.0


def asks_two_choices(example, client):
    try:  # the endpoint refuses n=2 with a 400; the run stops even though the agent carries on
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=2)
    except Exception:
        pass
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    return 0.0


def embeddings(example, client):
    client.embeddings.create(model="policy", input="x")
    return 0.0


def malformed_body(example, client):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{client.base_url}chat/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request)
    except urllib.error.HTTPError as exc:
        assert exc.code == 400 and "not JSON" in json.loads(exc.read())["error"]["message"]
    time.sleep(60)  # far past the test's rollout.env_timeout_s (a daemon thread: nothing waits for it)
    return 0.0


def returns_text(example, client):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    return "great"


def one_argument(example):
    return 0.0
