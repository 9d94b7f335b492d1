"""A verifiers (0.4, ``verifiers.v1``) environment built in code: taskset id ``vf-tiny-sums``, for
tests/cpu/trainer/rollout/test_verifiers_agent.py (which puts this folder on sys.path, as installing the package
would). Tasks ask for a sum; ``@vf.reward`` scores the final reply against the answer.

It bundles its harness (verifiers' default for a taskset whose module exports one): one chat
completion, made in-process through the rollout's interception endpoint, not streamed. verifiers'
``null`` harness does the same in a ``uv`` script that streams.
"""
import verifiers.v1 as vf
from openai import AsyncOpenAI

SUMS = [("2+3", "5"), ("4+4", "8"), ("1+6", "7"), ("3+3", "6"), ("9+0", "9"), ("5+2", "7"),
        ("8+1", "9"), ("2+2", "4")]


class SumData(vf.TaskData):
    answer: str = ""
    broken: bool = False  # the reward raises: a failed episode


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace) -> float:
        if self.data.broken:
            raise KeyError("no rubric today")
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply) <= 2)


class SumsConfig(vf.TasksetConfig):
    count: int = len(SUMS)
    system_prompt_text: str | None = None
    broken: bool = False


class TinySums(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for prompt, answer in SUMS[: self.config.count]:
            data = SumData(prompt=f"{prompt}=", answer=answer, system_prompt=self.config.system_prompt_text,
                           broken=self.config.broken)
            yield SumTask(data, self.config.task)


class OneReply(vf.Harness[vf.HarnessConfig]):
    """One non-streamed chat completion on the task's prompt, in-process."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def plain_agent(example, client) -> float:
    """The same conversation and score as a plain ``rollout.agent`` function: the test's reference."""
    reply = client.chat.completions.create(model="any", messages=list(example.messages))
    text = (reply.choices[0].message.content or "").strip()
    return float(text == example.answer) + 0.5 * float(len(text) <= 2)


__all__ = ["TinySums", "OneReply"]
