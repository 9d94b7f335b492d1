"""What this machine can hold, checked before any work (``polyfsdp-train`` calls :func:`check_fits`
after the config is built; ``--estimate``, trainer/run/estimate.py, prints the whole job's memory)."""
from __future__ import annotations

import os

from polyfsdp.engines.config import TORCH_DTYPES
from polyfsdp.engines.memory import hf_config_of, kv_cache_bytes
from polyfsdp.engines.presets import preset_config

from ..errors import ConfigError
from .rollout_check import SEPARATE_SAMPLERS


def check_fits(cfg, world_size: int) -> None:
    """One ConfigError, before any work, for a job this machine cannot run at all: more
    ``trainer.cpu_threads`` than CPUs this process may use (thousands of threads fail to start or
    crawl), or an RL rollout whose KV cache alone exceeds the memory one process can use. The
    cache is a floor, not the estimate: every completion of a rank's share decodes at once
    (trainer/rollout/decode.py), prompts counted at one token, no weights; it needs no data, so
    ``prompts_per_step=1000000`` answers in a second where ``--estimate`` reads every step's prompts."""
    threads = cfg.trainer.cpu_threads
    if threads is not None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if threads > cpus:
            raise ConfigError(f"trainer.cpu_threads: expected at most {cpus} (the CPUs this process may run on), "
                              f"got {threads}")
    # vLLM pages its cache and admits what fits, so only the built-in samplers hold every row.
    if not cfg.algo.rl or cfg.trainer.rl_steps < 1 or cfg.rollout.engine in SEPARATE_SAMPLERS:
        return
    from polyfsdp.backends import get_backend

    capacity = get_backend(cfg.backend).memory_capacity_bytes()
    if capacity is None:
        return
    g, t = cfg.algo.actor, cfg.trainer
    rows = t.prompts_per_step // (world_size // cfg.engine.ulysses_sp_size) * g.group_size  # a rank's share
    hf_config = hf_config_of(cfg.model.model_config()) if cfg.model.path else \
        preset_config(cfg.model.preset, **dict(cfg.model.overrides))
    hf_config = hf_config.get_text_config()  # a vision-language model's cache is its text decoder's
    floor = kv_cache_bytes(hf_config, rows, 1 + g.max_new_tokens, TORCH_DTYPES[cfg.engine.param_dtype].itemsize)
    if floor > capacity:
        raise ConfigError(
            f"trainer.prompts_per_step={t.prompts_per_step} x algo.actor.group_size={g.group_size}: a rank's "
            f"{rows} completions of up to {g.max_new_tokens} tokens need at least {floor / 2 ** 30:.1f} GiB of KV "
            f"cache, more than the {capacity / 2 ** 30:.1f} GiB this machine has per process; lower them or "
            f"algo.actor.max_new_tokens, or add ranks (--estimate prints the whole job's memory)")
