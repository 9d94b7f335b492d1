"""What this machine can hold, checked before any work (``polyfsdp-train`` calls :func:`check_fits`
after the config is built, ``polyfsdp-eval`` :func:`check_eval_fits` before it loads the model;
``--estimate``, trainer/run/estimate.py, prints the whole job's memory)."""
from __future__ import annotations

import os
from dataclasses import dataclass

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
    _check_threads(cfg)
    t = cfg.trainer
    trains_sft = t.sft_steps > 0
    samples_rl = cfg.algo.rl and t.rl_steps > 0 and _decodes_every_row(cfg)
    machine = _Machine.of(cfg, world_size) if trains_sft or samples_rl else None
    if machine is None:
        return
    if trains_sft:
        _check_sft_fits(cfg, machine)
    if samples_rl:
        g = cfg.algo.actor
        rows = t.prompts_per_step // machine.replicas * g.group_size  # a rank's share
        _check_kv_cache(machine, rows, g.max_new_tokens,
                        f"trainer.prompts_per_step={t.prompts_per_step} x algo.actor.group_size={g.group_size}",
                        "lower them or algo.actor.max_new_tokens, or add ranks (--estimate prints the whole job's "
                        "memory)")


def check_eval_fits(cfg, world_size: int) -> None:
    """:func:`check_fits` for ``polyfsdp-eval``, before the model is loaded: the CPU threads, and
    the KV cache of one evaluation generate call, whose floor is one prompt's ``eval.n_samples``
    completions (a call decodes up to 256 completions, at least one prompt's) of the evaluation's
    new tokens (``algo.actor.max_new_tokens``; without an RL phase the longest answer + 2,
    counted at 2). Training's floors are not the evaluation's: a run trained on a larger machine
    evaluates on a smaller one."""
    _check_threads(cfg)
    if not _decodes_every_row(cfg):
        return
    machine = _Machine.of(cfg, world_size)
    if machine is None:
        return
    n, actor = cfg.eval.n_samples, cfg.algo.actor
    new_tokens = actor.max_new_tokens if actor is not None else 2
    # More ranks do not lower it: each still decodes at least one prompt's samples at once.
    _check_kv_cache(machine, n, new_tokens, f"eval.n_samples={n}",
                    "lower it or algo.actor.max_new_tokens" if actor is not None else "lower it")


def _check_threads(cfg) -> None:
    threads = cfg.trainer.cpu_threads
    if threads is not None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if threads > cpus:
            raise ConfigError(f"trainer.cpu_threads: expected at most {cpus} (the CPUs this process may run on), "
                              f"got {threads}")


def _decodes_every_row(cfg) -> bool:
    """Whether the sampler holds every row's cache: vLLM pages its cache and admits what fits,
    so only the built-in samplers do."""
    return cfg.rollout.engine not in SEPARATE_SAMPLERS


@dataclass
class _Machine:
    """What the floors are measured against: one process's memory, the model's text config."""

    capacity: int
    replicas: int
    hf_config: object
    compute_bytes: int

    @classmethod
    def of(cls, cfg, world_size: int) -> _Machine | None:
        """None when the backend cannot tell its memory."""
        from polyfsdp.backends import get_backend

        capacity = get_backend(cfg.backend).memory_capacity_bytes()
        if capacity is None:
            return None
        if cfg.model.path:
            try:
                hf_config = hf_config_of(cfg.model.model_config())
            except (OSError, ValueError):
                # A config this check cannot read (missing, malformed, remote code) is the model
                # load's to report, in its own one line; the check is only a floor.
                return None
        else:
            hf_config = preset_config(cfg.model.preset, **dict(cfg.model.overrides))
        # A vision-language model's cache and activations are its text decoder's.
        return cls(capacity, world_size // cfg.engine.ulysses_sp_size, hf_config.get_text_config(),
                   TORCH_DTYPES[cfg.engine.param_dtype].itemsize)


def _check_kv_cache(machine: _Machine, rows: int, new_tokens: int, what: str, fix: str) -> None:
    floor = kv_cache_bytes(machine.hf_config, rows, 1 + new_tokens, machine.compute_bytes)
    if floor > machine.capacity:
        raise ConfigError(
            f"{what}: a rank's {rows} completions of up to {new_tokens} tokens need at least {floor / 2 ** 30:.1f} "
            f"GiB of KV cache, more than the {machine.capacity / 2 ** 30:.1f} GiB this machine has per process; "
            f"{fix}")


def _check_sft_fits(cfg, machine: _Machine) -> None:
    """The SFT floor of :func:`check_fits`: a rank's micro-batch's saved activations."""
    t, e = cfg.trainer, cfg.engine
    sequences = -(-t.sft_batch_size // machine.replicas)  # a rank's share (the first replicas take one more)
    # Ulysses SP splits a replica's tokens over its group; a micro-batch holds at least one sequence.
    tokens = -(-sequences * 2 // e.ulysses_sp_size)
    budget = e.max_tokens_per_micro_batch
    micro = tokens if budget is None else min(tokens, max(budget, 2))
    floor = saved_activation_bytes(machine.hf_config, micro, machine.compute_bytes, e.gradient_checkpointing)
    if floor > machine.capacity:
        batch = "in one micro-batch (engine.max_tokens_per_micro_batch=null)" if budget is None else \
            f"in micro-batches of engine.max_tokens_per_micro_batch={budget} tokens"
        raise ConfigError(
            f"trainer.sft_batch_size={t.sft_batch_size}: a rank's {sequences} sequences of at least 2 tokens each, "
            f"{batch}, need at least {floor / 2 ** 30:.1f} GiB of saved activations to train, more than the "
            f"{machine.capacity / 2 ** 30:.1f} GiB this machine has per process; lower it, cap the micro-batch "
            f"with engine.max_tokens_per_micro_batch (gradient accumulation), or add ranks (--estimate prints "
            f"the whole job's memory)")
