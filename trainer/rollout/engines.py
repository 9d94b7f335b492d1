"""Rollout engines: what samples the completions of a rollout (``rollout.engine``).

- ``builtin``: polyfsdp's decoding loop on the FSDP policy (trainer/rollout/decode.py);
- ``hf``: Hugging Face ``generate`` on the FSDP policy (ranks in lockstep without gather-once);
- ``vllm``: a vLLM engine per rank holding a copy of the policy's weights, synced after every
  optimizer step (trainer/rollout/vllm.py; needs vLLM installed);
- ``auto``: the decoding loop wherever no rank must keep calling forward for the others,
  else HF ``generate`` (what polyfsdp did before engines were selectable), on every backend.

Every engine takes ``row_seeds`` (one sampling seed per prompt, trainer/rollout/row_seeds.py, or None:
the process's generator draws) and returns what :func:`polyfsdp.trainer.rollout.generate.generate`
documents: per prompt its new tokens ending at and including ``<eos>`` when produced, and with
``return_log_probs`` each token's log-prob under the distribution it was drawn from.
"""
from __future__ import annotations

from ..errors import ConfigError

ROLLOUT_ENGINES = ("auto", "builtin", "hf", "vllm")
# rollout.unshard (trainer/rollout/generate.py: use_gather_once); checked here, with the rest of the
# section, so the config check needs nothing of the sampling code.
UNSHARD_CHOICES = ("auto", True, False)


def check_unshard(unshard) -> None:
    """Raise ValueError unless ``unshard`` is one of ``rollout.unshard``'s values."""
    if unshard not in UNSHARD_CHOICES:
        raise ValueError(f"rollout.unshard: got {unshard!r}; allowed values: auto, true, false")


class RolloutEngine:
    """The interface: ``generate`` (and ``close`` to free what the engine holds)."""

    name = "rollout engine"

    def generate(self, policy, tokenizer, prompts: list[list[int]], max_new_tokens: int, do_sample: bool,
                 temperature: float = 1.0, return_log_probs: bool = False, row_seeds: list[int] | None = None):
        raise NotImplementedError

    def close(self) -> None:
        """Free the engine's resources (a no-op for engines that sample with the policy itself)."""


class PolicyDecoding(RolloutEngine):
    """Sampling with the FSDP policy itself: ``loop`` is ``builtin``, ``hf`` or ``auto``
    (trainer/rollout/generate.py); ``unshard`` is ``rollout.unshard``."""

    def __init__(self, loop: str = "auto", unshard="auto") -> None:
        self.loop, self.unshard, self.name = loop, unshard, loop

    def generate(self, policy, tokenizer, prompts, max_new_tokens, do_sample, temperature=1.0,
                 return_log_probs=False, row_seeds=None):
        from .generate import generate

        return generate(policy, tokenizer, prompts, max_new_tokens, do_sample, temperature, return_log_probs,
                        unshard=self.unshard, loop=self.loop, row_seeds=row_seeds)


def check_rollout(rollout, world_size: int = 1) -> None:
    """Raise ConfigError for a ``rollout`` section (trainer/config/job.py) that cannot run."""
    try:
        check_unshard(rollout.unshard)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if rollout.engine not in ROLLOUT_ENGINES:
        raise ConfigError(f"rollout.engine: got {rollout.engine!r}; allowed values: {', '.join(ROLLOUT_ENGINES)}")
    if rollout.engine == "builtin" and rollout.unshard is False and world_size > 1:
        raise ConfigError("rollout.engine=builtin with rollout.unshard=false: on several ranks our decoding loop "
                          "needs the model gathered once; set rollout.unshard=auto, or rollout.engine=hf to decode "
                          "in lockstep with per-layer gathers")
    if not rollout.sync_bucket_mb > 0:
        raise ConfigError(f"rollout.sync_bucket_mb: expected a number > 0, got {rollout.sync_bucket_mb!r}")
    if not rollout.check_sync_tol > 0:
        raise ConfigError(f"rollout.check_sync_tol: expected a number > 0, got {rollout.check_sync_tol!r}")
    from .vllm import VllmSettings

    VllmSettings.from_section(rollout.vllm)
    if isinstance(rollout.max_turns, bool) or not isinstance(rollout.max_turns, int) or rollout.max_turns < 1:
        raise ConfigError(f"rollout.max_turns: expected an int >= 1, got {rollout.max_turns!r}")
    if rollout.env is None and rollout.max_turns > 1:
        raise ConfigError("rollout.max_turns > 1 needs an environment to answer the turns: set rollout.env "
                          "(a built-in such as calculator, path/to/file.py:Class or package.module:Class)")
    total = rollout.max_total_tokens
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 2):
        raise ConfigError(f"rollout.max_total_tokens: expected an int >= 2 or null, got {total!r}")
    if rollout.env is not None:
        from .environments import load_environment

        load_environment(rollout.env)  # a missing file or class is one line before any model is built


def build_rollout_engine(rollout, backend, lora: bool = False, max_positions: int | None = None) -> RolloutEngine:
    """The rollout engine ``rollout.engine`` names (config checked by :func:`check_rollout`),
    running conversations with ``rollout.env`` when one is set."""
    if rollout.engine == "vllm":
        from .vllm import VllmRolloutEngine

        engine = VllmRolloutEngine(rollout, backend, lora=lora)
    else:
        engine = PolicyDecoding(rollout.engine, rollout.unshard)
    if rollout.env is None:
        return engine
    return multi_turn_engine(rollout, engine, max_positions)


def multi_turn_engine(rollout, engine, max_positions: int | None):
    """The multi-turn rollout engine (trainer/rollout/multi_turn.py) of ``rollout.env`` over ``engine``."""
    from .multi_turn import MultiTurnRollout, MultiTurnSettings

    settings = MultiTurnSettings(rollout.env, dict(rollout.env_kwargs or {}), rollout.max_turns,
                                 rollout.max_total_tokens, rollout.env_add_reward_fn, rollout.env_timeout_s)
    return MultiTurnRollout(engine, settings, max_positions)
