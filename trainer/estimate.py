"""``polyfsdp-train ... --estimate``: the per-rank memory table of the configured run
(engines/memory.py), printed before anything is built on a device."""
from __future__ import annotations

from polyfsdp.engines.memory import estimate_memory, hf_config_of
from polyfsdp.engines.presets import preset_config

from .compose import ConfigError


def micro_batch_tokens(cfg, hf_config, world_size: int) -> tuple[int, str]:
    """Tokens per micro-batch and where the number comes from: the engine's budget, else an
    upper bound (a rank's whole SFT batch at the model's full length)."""
    if cfg.engine.max_tokens_per_micro_batch is not None:
        return cfg.engine.max_tokens_per_micro_batch, "engine.max_tokens_per_micro_batch"
    sequences = max(1, cfg.trainer.sft_batch_size // world_size)
    positions = hf_config.max_position_embeddings
    return sequences * positions, (f"upper bound: {sequences} sequences x {positions} positions; "
                                   f"set engine.max_tokens_per_micro_batch for the budget")


def print_estimate(cfg, world_size: int) -> None:
    """Print the memory table of ``cfg``'s model and engine on ``world_size`` ranks."""
    model_config = cfg.model.model_config()
    # The trainer resizes a preset with model.overrides (trainer/model_init.py).
    try:
        hf_config = hf_config_of(model_config) if cfg.model.path else \
            preset_config(cfg.model.preset, **dict(cfg.model.overrides))
    except ValueError as exc:
        raise ConfigError(f"model.path: {str(exc).removeprefix('ModelConfig.path: ')}") from None
    tokens, source = micro_batch_tokens(cfg, hf_config, world_size)
    estimate = estimate_memory(model_config, cfg.engine, world_size=world_size, tokens=tokens,
                               host_backend=cfg.backend == "cpu", hf_config=hf_config)
    print(f"memory estimate: world size {world_size}, master {model_config.dtype}, compute {cfg.engine.param_dtype}, "
          f"LoRA rank {model_config.lora.rank}, offload {cfg.engine.offload}, {tokens} tokens per micro-batch "
          f"({source})")
    print(estimate.table())
