"""The job's rollout engine and driver, from the ``rollout`` config section (checked by
trainer/config/rollout_check.py). Implementations are imported only when chosen: vLLM's and the
servers' need packages a default job does not."""
from __future__ import annotations

from .drivers.single_turn import SingleTurnDriver
from .engines import PolicyDecoding, RolloutEngine
from .drivers.multi_turn import MultiTurnDriver, MultiTurnSettings


def build_rollout_engine(rollout, backend, lora: bool = False, log_dir: str | None = None,
                         processor_factory=None) -> RolloutEngine:
    """The rollout engine ``rollout.engine`` names; ``log_dir``: where started rollout servers
    write their logs (default: a temporary directory); ``processor_factory``: builds a
    vision-language policy's processor, for vLLM (colocated or on servers), which processes a
    prompt's images itself."""
    if rollout.engine == "vllm":
        from .vllm import VllmRolloutEngine

        engine = VllmRolloutEngine(rollout, backend, lora=lora)
        engine.processor_factory = processor_factory
        return engine
    if rollout.engine == "vllm_server":
        from .servers.engine import ServerRolloutEngine

        engine = ServerRolloutEngine(rollout, backend, lora=lora, log_dir=log_dir)
        engine.processor_factory = processor_factory
        return engine
    return PolicyDecoding(rollout.engine, rollout.unshard)


def build_rollout_driver(rollout, engine: RolloutEngine, max_positions: int | None = None):
    """What runs examples through ``engine``: conversations with ``rollout.env`` when one is set,
    else one completion per row."""
    if rollout.env is None and rollout.agent is None:
        return SingleTurnDriver(engine)
    return multi_turn_driver(rollout, engine, max_positions)


def multi_turn_driver(rollout, engine: RolloutEngine, max_positions: int | None):
    """The multi-turn driver (trainer/rollout/drivers/multi_turn.py) of ``rollout.env`` over ``engine``,
    or of ``rollout.agent`` (trainer/rollout/drivers/agent.py: its agents are the environments)."""
    settings = MultiTurnSettings(rollout.agent or rollout.env, dict(rollout.env_kwargs or {}), rollout.max_turns,
                                 rollout.max_total_tokens, rollout.env_add_reward_fn, rollout.env_timeout_s)
    if rollout.agent is not None:
        from .drivers.agent import AgentDriver

        return AgentDriver(engine, settings, max_positions, rollout.agent_concurrency)
    return MultiTurnDriver(engine, settings, max_positions)
