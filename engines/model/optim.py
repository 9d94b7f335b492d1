"""AdamW, the learning-rate schedules (constant, linear warmup + cosine decay), and the
master-weight dtypes AdamW can train."""
from __future__ import annotations

import logging
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..config import OptimConfig
from ..parallel.host_optimizer import HostAdamW

logger = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, config: OptimConfig, on_host: bool = False) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter (weight decay applied to all of them), with the
    kernel ``config.impl`` names; ``on_host`` (offload=optimizer) keeps its state and step on
    the host (engines/parallel/host_optimizer.py: always torch's for-loop kernel there)."""
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
    if on_host:
        if config.impl not in ("auto", "for_loop"):
            logger.warning("OptimConfig.impl=%r does not apply with engine.offload=optimizer: the host step "
                           "runs torch's for-loop AdamW", config.impl)
        return HostAdamW(params, **hyper)
    kernel = {"auto": {}, "for_loop": {"foreach": False}, "foreach": {"foreach": True},
              "fused": {"fused": True}}[config.impl]
    return torch.optim.AdamW(params, **hyper, **kernel)


def check_master_dtype(dtype: str, warned: bool) -> bool:
    """Refuse float16 master weights; warn about bfloat16 ones unless ``warned``. Returns
    whether the bfloat16 warning has been given."""
    if dtype == "float16":
        # AdamW's eps (1e-8) rounds to 0 in float16: a zero gradient gives 0/0 = NaN weights.
        raise ValueError("train_batch: ModelConfig.dtype='float16' keeps the master weights in float16, "
                         "which AdamW turns into NaN; use ModelConfig.dtype='float32' with "
                         "EngineConfig.param_dtype='float16' (float16 compute, float32 weights)")
    if dtype == "bfloat16" and not warned:
        # bf16 keeps ~3 significant digits: lr-sized AdamW updates mostly round away.
        logger.warning("train_batch: ModelConfig.dtype='bfloat16' keeps the master weights in bfloat16, "
                       "where small updates round to nothing; for training prefer ModelConfig.dtype="
                       "'float32' with EngineConfig.param_dtype='bfloat16'")
        return True
    return warned


def lr_factor(step: int, config: OptimConfig) -> float:
    """Multiplier of ``config.lr`` at optimizer step ``step`` (0-based).

    Both schedules warm up linearly over ``warmup_steps`` ((step + 1) / warmup); then
    ``constant`` stays at 1 and ``warmup_cosine`` decays to ``min_lr_ratio`` at ``total_steps``.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_scheduler == "constant":
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> LambdaLR:
    """A LambdaLR following :func:`lr_factor`; step it once per optimizer step."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, config))
