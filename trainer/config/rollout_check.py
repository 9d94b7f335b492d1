"""The ``rollout`` config section's checks (trainer/config/job.py calls :func:`check_rollout`).

A leaf of the rollout layer: it imports no engine, so checking a config needs nothing of the
sampling code (the vLLM and environment checks it needs are imported when they run).
"""
from __future__ import annotations

from ..errors import ConfigError

# rollout.engine's values; trainer/rollout/build.py constructs each.
ROLLOUT_ENGINES = ("auto", "builtin", "hf", "vllm", "vllm_server")
# The engines that sample with a copy of the weights of their own (synced after every step).
SEPARATE_SAMPLERS = ("vllm", "vllm_server")
# rollout.unshard (trainer/rollout/generate.py: use_gather_once).
UNSHARD_CHOICES = ("auto", True, False)


def check_unshard(unshard) -> None:
    """Raise ValueError unless ``unshard`` is one of ``rollout.unshard``'s values."""
    if unshard not in UNSHARD_CHOICES:
        raise ValueError(f"rollout.unshard: got {unshard!r}; allowed values: auto, true, false")


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
    if isinstance(rollout.max_turns, bool) or not isinstance(rollout.max_turns, int) or rollout.max_turns < 1:
        raise ConfigError(f"rollout.max_turns: expected an int >= 1, got {rollout.max_turns!r}")
    if rollout.env is not None and rollout.agent is not None:
        raise ConfigError(f"rollout.env={rollout.env} and rollout.agent={rollout.agent}: set one (an environment "
                          f"class, or an agent that talks to the model through the OpenAI API)")
    if rollout.env is None and rollout.agent is None and rollout.max_turns > 1:
        raise ConfigError("rollout.max_turns > 1 needs an environment to answer the turns: set rollout.env "
                          "(a built-in such as calculator, path/to/file.py:Class or package.module:Class) "
                          "or rollout.agent")
    concurrency = rollout.agent_concurrency
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"rollout.agent_concurrency: expected an int >= 1, got {concurrency!r}")
    total = rollout.max_total_tokens
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 2):
        raise ConfigError(f"rollout.max_total_tokens: expected an int >= 2 or null, got {total!r}")
    if rollout.env is not None:
        from ..rollout.environments import load_environment

        load_environment(rollout.env)  # a missing file or class is one line before any model is built
    if rollout.agent is not None:
        from ..rollout.drivers.agent import load_agent

        load_agent(rollout.agent, rollout.env_kwargs)  # the openai package, the file and the function, before any model
