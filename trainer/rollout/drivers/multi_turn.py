"""Multi-turn rollouts (``rollout.env``): the policy and an environment take turns, and each
trajectory becomes ONE training sequence.

Token bookkeeping, the part that must be exact:
- the tokens the sampler drew are kept as drawn (never decoded and re-encoded) with
  ``loss_mask = 1`` and the sampler's log-probs;
- the environment's messages enter as the chat template renders them after an assistant turn
  (:class:`ChatTurns`), with ``loss_mask = 0``;
- every turn's prompt is the trajectory's tokens so far, so the sequence the trainer scores is
  token for token the one the sampler conditioned on.

Turns run for the whole batch at once (rows that are done leave); the limits are
``rollout.max_turns`` assistant turns, ``max_new_tokens`` per turn, and a total of
``rollout.max_total_tokens`` (default: the model's ``max_position_embeddings``): a trajectory
whose next turn would not fit ends there (``multi_turn/truncated``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from polyfsdp.backends.distributed import all_reduce_max, current_world_size

from ..engines import RolloutEngine, SamplingParams
from ..controls.stop_strings import StopStrings
from ...data.chat import end_of_turn_token_id, text_prompt_tokens
from ..environments import as_env_step, check_messages, load_environment, parse_tool_calls
from ...errors import RewardError
from ...rank_errors import on_every_rank
from ...rewards.timeout import CallDeadline
from ..row_seeds import turn_seed
from ...rewards.reward_fn import MAX_ABS_REWARD, call_user_code
from .result import Rollout, refuse_images

# A placeholder exchange: the tokens the template puts around an environment turn are the
# difference between rendering it after this exchange and rendering the exchange alone.
_EXCHANGE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatTurns:
    """Token ids of chat turns through the tokenizer's template (with the environment's tools)."""

    def __init__(self, tokenizer, tools) -> None:
        self.tokenizer, self.tools = tokenizer, list(tools or []) or None
        head = self._render(_EXCHANGE, generation_prompt=False)
        # What the template writes after an assistant turn's last stop token (eos, or the template's
        # end-of-turn token: ChatML's <|im_end|>, then "\n"); the sampler stops at that token, so
        # these close the turn before the environment speaks.
        enders = {tokenizer.eos_token_id, end_of_turn_token_id(tokenizer)}
        last = max((i for i, tok in enumerate(head) if tok in enders), default=None)
        self.closing = head[last + 1:] if last is not None else []
        self._head = head

    def _render(self, messages, generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                       tools=self.tools))

    def prompt(self, messages) -> list[int]:
        """The first prompt: ``messages`` and the assistant's generation prompt."""
        return self._render(messages, generation_prompt=True)

    def after_assistant(self, messages, ended_with_eos: bool) -> list[int]:
        """The tokens that follow an assistant turn: the turn's closing (when the sampler ended it
        with a stop token), ``messages`` as the template renders them, and the next generation prompt."""
        full = self._render(_EXCHANGE + list(messages), generation_prompt=True)
        if full[:len(self._head)] != self._head:
            raise ValueError("the tokenizer's chat template renders an exchange differently once more messages "
                             "follow it, so environment turns cannot be appended token-exactly")
        return (self.closing if ended_with_eos else []) + full[len(self._head):]


def _joined(messages) -> str:
    return "".join(m["content"] for m in messages)


class TextTurns:
    """The turns of a plain-text conversation (an agent's ``/v1/completions``), as
    :class:`ChatTurns` renders chat ones: its prompt is ``<bos>`` and the text's tokens; what
    follows a sampled completion is the added text's tokens, with no template (agent.py's
    AgentEnv passes each text as one message)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt(self, messages) -> list[int]:
        return text_prompt_tokens(self.tokenizer, _joined(messages))

    def after_assistant(self, messages, ended_with_eos: bool) -> list[int]:
        return self.tokenizer.encode(_joined(messages))


@dataclass
class Trajectory:
    """One conversation: its prompt, then every token after it with its mask and log-prob."""

    example: object
    env: object
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    truncated: bool = False
    done: bool = False
    last_text: str = ""
    render: object = None  # how its turns become tokens (ChatTurns; an agent's completions: TextTurns)
    cut: str = ""  # the limit that ended it (with truncated), for messages

    def add(self, tokens, sampled: bool, log_probs=None) -> None:
        self.tokens += list(tokens)
        self.loss_mask += [int(sampled)] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


@dataclass
class MultiTurnSettings:
    env: str
    env_kwargs: dict
    max_turns: int
    max_total_tokens: int | None
    add_reward_fn: bool
    timeout_s: float | None = 60.0


class MultiTurnDriver:
    """The rollout driver (trainer/rollout/drivers/) that runs conversations with an environment;
    ``engine`` samples each turn."""

    # What error lines call the environment (the agent driver, agent.py, names its agent).
    label_key = "rollout.env"

    def __init__(self, engine: RolloutEngine, settings: MultiTurnSettings, max_positions: int | None,
                 env_class=None) -> None:
        self.engine, self.settings = engine, settings
        self.env_class = env_class or load_environment(settings.env)
        self.max_total = settings.max_total_tokens or max_positions
        self.name = f"{engine.name} + {settings.env}"
        self._deadline = CallDeadline(settings.timeout_s) if settings.timeout_s is not None else None

    def _env_call(self, trajectory, method: str, turn: int, call, check):
        """``check(call())``: the environment's ``method`` under ``rollout.env_timeout_s``, its
        result checked; every failure one line naming the environment, the record and the turn."""
        where = f"{self.label_key}={self.settings.env} {method}()"
        record = trajectory.example.where or f"with prompt {trajectory.example.prompt!r}"
        context = f"(record {record}, turn {turn})"
        result = call_user_code(call, where, context, self._deadline, "rollout.env_timeout_s")
        try:
            return check(result, where)
        except ValueError as exc:
            raise RewardError(f"{exc} {context}") from None

    def _add_reward(self, trajectory, reward: float, turn: int) -> None:
        """Add a turn's (finite) reward to the conversation's; a total beyond +-MAX_ABS_REWARD
        (1e308 twice is inf) is one line naming the environment, the record and the turn here,
        not a non-finite advantage deep in the engine."""
        total = trajectory.reward + reward
        if not (math.isfinite(total) and abs(total) <= MAX_ABS_REWARD):
            record = trajectory.example.where or f"with prompt {trajectory.example.prompt!r}"
            raise RewardError(f"{self.label_key}={self.settings.env} step() rewards add up to {total:g} after turn "
                              f"{turn} "
                              f"(this turn's {reward:g}), beyond +-{MAX_ABS_REWARD:g}: group means and variances "
                              f"of larger rewards overflow; scale the environment's rewards (record {record}, "
                              f"turn {turn})")
        trajectory.reward = total

    def _overflows(self, trajectory, more: int) -> bool:
        """Whether ``more`` tokens after the trajectory's would pass ``max_total_tokens``."""
        return self.max_total is not None and len(trajectory.prompt) + len(trajectory.tokens) + more > self.max_total

    def start(self, examples, n: int, tokenizer):
        """``n`` fresh conversations per example (the environment's ``reset``, its prompt tokens),
        each with its renderer (``Trajectory.render``); the SFT phase starts its demonstrations
        here too (trainer/algos/tool_sft.py), so both tokenize a conversation alike."""
        refuse_images(examples, self.label_key, self.settings.env)
        trajectories, turns = [], None
        for example in examples:
            for _ in range(n):
                env = self.env_class(**self.settings.env_kwargs)
                holder = Trajectory(example, env, [])
                messages = self._env_call(holder, "reset", 0, lambda: env.reset(example), check_messages)
                holder.render = turns = self.renderer(env, tokenizer, turns)
                holder.prompt = holder.render.prompt(messages)
                trajectories.append(holder)
        return trajectories

    def renderer(self, env, tokenizer, previous):
        """The :class:`ChatTurns` of a conversation just reset: one for the whole batch (every
        environment of a driver is one class, so the first one's tools are every one's)."""
        return previous if previous is not None else ChatTurns(tokenizer, getattr(env, "tools", None))

    def rollout(self, tokenizer, examples, n: int, params: SamplingParams, scorer=None, with_answers: bool = False,
                row_seeds: list[int] | None = None, device=None) -> Rollout:
        """``n`` conversations per example (grouped as every driver's rows, trainer/rollout/drivers/),
        ``params.max_new_tokens`` per turn; ``with_answers``: no answer to vote on (None each), the
        environment judges; ``row_seeds`` (one per conversation): turn ``t`` of each samples with
        ``turn_seed(its seed, t)``; ``device``: the policy's, where ranks agree on taking a turn."""
        stop_ids, max_new_tokens = set(params.stop_token_ids), params.max_new_tokens
        stop_strings = StopStrings(params)
        # Every turn keeps its tokens' log-probs (the trajectory's); the rollout returns them when asked.
        turn_params = replace(params, return_log_probs=True)
        started = time.perf_counter()
        trajectories = on_every_rank(lambda: self.start(examples, n, tokenizer))
        env_time = time.perf_counter() - started
        position = {id(t): i for i, t in enumerate(trajectories)}
        for turn in range(1, self.settings.max_turns + 1):
            active = [t for t in trajectories if not t.done]
            for t in active:
                if self._overflows(t, max_new_tokens):
                    t.done = t.truncated = True
                    t.cut = f"rollout.max_total_tokens={self.max_total}: another turn would not fit"
            active = [t for t in active if not t.done]
            seeds = None if row_seeds is None else \
                [turn_seed(row_seeds[position[id(t)]], turn) for t in active] or [0]
            # Sampling may be collective (synced decoding): every rank takes the turn while any
            # rank has a conversation going; one with none samples a stand-in row and drops it.
            if current_world_size() > 1:
                if all_reduce_max([float(len(active))], device)[0] == 0:
                    break
            elif not active:
                break
            # A rank with no conversation at all (agent.py's padding rounds) samples from <bos>.
            contexts = [t.prompt + t.tokens for t in active] or \
                [trajectories[0].prompt if trajectories else [tokenizer.bos_token_id or 0]]
            out = self.engine.generate(contexts, turn_params, seeds)
            completions, log_probs = out.token_ids, out.log_probs
            started = time.perf_counter()

            def answer(active=active, completions=completions, log_probs=log_probs, turn=turn):
                self.deliver(active, completions, tokenizer, params)
                for t, tokens, lps in zip(active, completions, log_probs):
                    t.add(tokens, sampled=True, log_probs=lps)
                    t.turns += 1
                    t.last_text = tokenizer.decode(tokens)
                    t.tool_calls += len(parse_tool_calls(t.last_text))
                    step = self._env_call(t, "step", turn, lambda: t.env.step(t.last_text), as_env_step)
                    self._add_reward(t, step.reward, turn)
                    # A stop token ends the turn (the template's closing follows it), so does a stop string.
                    by_token = bool(tokens) and tokens[-1] in stop_ids
                    ended = by_token or (bool(stop_strings) and stop_strings.hit(tokens))
                    if step.done:
                        t.done = True
                    elif turn == self.settings.max_turns:  # the environment would go on: a limit
                        t.done = t.truncated = True
                        t.cut = f"rollout.max_turns={turn} reached"
                    elif not ended:  # the turn hit max_new_tokens: the conversation cannot go on
                        t.done = t.truncated = True
                        t.cut = f"the turn reached algo.actor.max_new_tokens={max_new_tokens} without a stop token"
                    else:
                        following = t.render.after_assistant(step.messages, by_token)
                        if self._overflows(t, len(following) + max_new_tokens):
                            # The environment's reply and one more turn would not fit: the
                            # conversation ends here (a reply nobody answers is not trained on).
                            t.done = t.truncated = True
                            t.cut = f"rollout.max_total_tokens={self.max_total}: the reply and another turn " \
                                    f"would not fit"
                        else:
                            t.add(following, sampled=False)

            on_every_rank(answer)
            env_time += time.perf_counter() - started
        if self.settings.add_reward_fn and scorer is not None:
            finals = [t.last_text for t in trajectories]
            rewards, _ = on_every_rank(lambda: scorer.score_all(examples, finals, [t.tokens for t in trajectories],
                                                                 group=n))
            for t, r in zip(trajectories, rewards):
                t.reward += r
        metrics = {"turns": [float(t.turns) for t in trajectories],
                   "tool_calls": [float(t.tool_calls) for t in trajectories],
                   "truncated": [float(t.truncated) for t in trajectories], **self.finish(trajectories)}
        return Rollout([t.prompt for t in trajectories], [t.tokens for t in trajectories],
                       [t.last_text for t in trajectories], [t.reward for t in trajectories], {},
                       [t.log_probs for t in trajectories] if params.return_log_probs else None,
                       answers=[None] * len(trajectories) if with_answers else None,
                       loss_masks=[t.loss_mask for t in trajectories],
                       rollout_metrics={**metrics, "env_time_s": [env_time]})


    def deliver(self, active, completions, tokenizer, params) -> None:
        """Before a turn's ``step`` calls: nothing here (the agent driver hands every sampled
        completion to its agent at once, so agents think in parallel)."""

    def finish(self, trajectories) -> dict[str, list[float]]:
        """After the last turn: more per-trajectory metrics (none here; the agent driver's)."""
        return {}


def rollout_metrics(values: dict[str, list[float]]) -> dict[str, float]:
    """Record entries for a rollout's own per-trajectory values, averaged over every rank's:
    ``multi_turn/turns_mean``, ``multi_turn/tool_calls_mean``, ``multi_turn/truncated_mean``
    (the share that hit a limit), ``multi_turn/env_time_s_mean``; a key with its own prefix keeps
    it (``agent/retokenization_mismatch``: the share of agent conversations whose history differed
    from the sampled one). Every rank must call it."""
    from ...rewards.reward_fn import mean_over_ranks

    if not values:
        return {}
    means = {key.removeprefix("reward/"): v for key, v in mean_over_ranks(values).items()}
    return {key if "/" in key else f"multi_turn/{key}_mean": v for key, v in means.items()}
