"""``--estimate`` rows of ``reward.model`` (trainer/run/estimate.py): its parameter shards,
resident in every phase (the job builds it at start), and its no-grad scoring pass over each RL
step's rollout, planned under its own token budget. The model is counted as a causal LM whose
output layer is ``hidden -> 1`` (a classifier's ``score`` layer; engines/memory.py: value_head)."""
from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError


def _memory(cfg, world_size: int):
    """The reward model's ModelMemory, or None without ``reward.model.path``."""
    from polyfsdp.engines.config import TORCH_DTYPES, ModelConfig
    from polyfsdp.engines.memory import ModelMemory, hf_config_of

    section = cfg.reward.model
    if section is None or section.path is None:
        return None
    model_config = ModelConfig(path=section.path, dtype=cfg.model.dtype)
    try:
        hf_config = hf_config_of(model_config)
    except ValueError as exc:
        raise ConfigError(f"reward.model.path: {str(exc).removeprefix('ModelConfig.path: ')}") from None
    budget = section.max_tokens_per_batch or cfg.engine.max_tokens_per_micro_batch
    engine_config = replace(cfg.engine, ulysses_sp_size=1, max_tokens_per_micro_batch=budget,
                            gradient_checkpointing=False, offload="params" if section.offload else cfg.engine.offload)
    memory = ModelMemory(model_config, engine_config, world_size, hf_config, value_head=True)
    if section.value_head_path is None:
        memory.params -= TORCH_DTYPES[cfg.model.dtype].itemsize  # a classifier's score layer has no bias (the head's one)
    return memory


def reward_model_rows(cfg, world_size: int, backend) -> dict[str, int]:
    """``{row name: bytes}`` of the reward model's resident shards (0 offloaded to the host)."""
    memory = _memory(cfg, world_size)
    if memory is None:
        return {}
    offloaded = memory.engine_config.offload == "params" and not backend.memory_is_host
    return {f"reward model parameters ({cfg.reward.model.name})": 0 if offloaded else memory.params}


def reward_model_steps(cfg, world_size: int, sequences: list[list[int]]) -> list[tuple[str, int, int, int]]:
    """``(name, rows, tokens, bytes)`` of the scoring pass over the rollout's sequence lengths (one
    list per replica): its largest micro-batch under the reward model's budget (counted at the
    policy's lengths: a re-tokenized text differs)."""
    from polyfsdp.engines.batch.micro import plan_micro_batches

    memory = _memory(cfg, world_size)
    if memory is None:
        return []
    budget, packed = memory.engine_config.max_tokens_per_micro_batch, cfg.engine.use_remove_padding
    best = (0, 0)
    for lengths in sequences:
        for group in plan_micro_batches(lengths, budget) if lengths else []:
            sizes = [lengths[i] for i in group]
            best = max(best, (sum(sizes) if packed else len(sizes) * max(sizes), len(sizes)))
    return [("reward model scoring (no grad)", best[1], best[0], memory.inference(best[0]))]
