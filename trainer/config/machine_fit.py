"""What this machine can hold, checked before any work (``polyfsdp-train`` calls :func:`check_fits`
after the config is built; ``--estimate``, trainer/run/estimate.py, prints the whole job's memory)."""
from __future__ import annotations

import os

from polyfsdp.engines.config import TORCH_DTYPES
from polyfsdp.engines.memory import hf_config_of, kv_cache_bytes, saved_activation_bytes
from polyfsdp.engines.presets import preset_config

from ..errors import ConfigError
from .rollout_check import SEPARATE_SAMPLERS


def check_fits(cfg, world_size: int) -> None:
    """One ConfigError, before any work, for a job this machine cannot run at all: more
    ``trainer.cpu_threads`` than CPUs this process may use (thousands of threads fail to start or
    crawl), an SFT step whose saved activations alone exceed the memory one process can use, or
    an RL rollout whose KV cache alone does. Each is a floor, not the estimate, and needs no data,
    so ``prompts_per_step=1000000`` answers in a second where ``--estimate`` reads every step's
    prompts: an SFT micro-batch holds a rank's share of ``sft_batch_size`` sequences (all of them
    unless ``engine.max_tokens_per_micro_batch`` caps it), each counted at 2 tokens (one prompt
    token, the answer's end); a rollout decodes every completion of a rank's share at once
    (trainer/rollout/decode.py), prompts counted at one token; no weights, no head."""
    threads = cfg.trainer.cpu_threads
    if threads is not None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if threads > cpus:
            raise ConfigError(f"trainer.cpu_threads: expected at most {cpus} (the CPUs this process may run on), "
                              f"got {threads}")
    t = cfg.trainer
    trains_sft = t.sft_steps > 0
    # vLLM pages its cache and admits what fits, so only the built-in samplers hold every row.
    samples_rl = cfg.algo.rl and t.rl_steps > 0 and cfg.rollout.engine not in SEPARATE_SAMPLERS
    if not (trains_sft or samples_rl):
        return
    from polyfsdp.backends import get_backend

    capacity = get_backend(cfg.backend).memory_capacity_bytes()
    if capacity is None:
        return
    replicas = world_size // cfg.engine.ulysses_sp_size
    hf_config = hf_config_of(cfg.model.model_config()) if cfg.model.path else \
        preset_config(cfg.model.preset, **dict(cfg.model.overrides))
    hf_config = hf_config.get_text_config()  # a vision-language model's cache is its text decoder's
    compute_bytes = TORCH_DTYPES[cfg.engine.param_dtype].itemsize
    if trains_sft:
        _check_sft_fits(cfg, hf_config, replicas, compute_bytes, capacity)
    if not samples_rl:
        return
    g = cfg.algo.actor
    rows = t.prompts_per_step // replicas * g.group_size  # a rank's share
    floor = kv_cache_bytes(hf_config, rows, 1 + g.max_new_tokens, compute_bytes)
    if floor > capacity:
        raise ConfigError(
            f"trainer.prompts_per_step={t.prompts_per_step} x algo.actor.group_size={g.group_size}: a rank's "
            f"{rows} completions of up to {g.max_new_tokens} tokens need at least {floor / 2 ** 30:.1f} GiB of KV "
            f"cache, more than the {capacity / 2 ** 30:.1f} GiB this machine has per process; lower them or "
            f"algo.actor.max_new_tokens, or add ranks (--estimate prints the whole job's memory)")


def _check_sft_fits(cfg, hf_config, replicas: int, compute_bytes: int, capacity: int) -> None:
    """The SFT floor of :func:`check_fits`: a rank's micro-batch's saved activations."""
    t, e = cfg.trainer, cfg.engine
    sequences = -(-t.sft_batch_size // replicas)  # a rank's share (the first replicas take one more)
    # Ulysses SP splits a replica's tokens over its group; a micro-batch holds at least one sequence.
    tokens = -(-sequences * 2 // e.ulysses_sp_size)
    budget = e.max_tokens_per_micro_batch
    micro = tokens if budget is None else min(tokens, max(budget, 2))
    floor = saved_activation_bytes(hf_config, micro, compute_bytes, e.gradient_checkpointing)
    if floor > capacity:
        batch = "in one micro-batch (engine.max_tokens_per_micro_batch=null)" if budget is None else \
            f"in micro-batches of engine.max_tokens_per_micro_batch={budget} tokens"
        raise ConfigError(
            f"trainer.sft_batch_size={t.sft_batch_size}: a rank's {sequences} sequences of at least 2 tokens each, "
            f"{batch}, need at least {floor / 2 ** 30:.1f} GiB of saved activations to train, more than the "
            f"{capacity / 2 ** 30:.1f} GiB this machine has per process; lower it, cap the micro-batch with "
            f"engine.max_tokens_per_micro_batch (gradient accumulation), or add ranks (--estimate prints the "
            f"whole job's memory)")
