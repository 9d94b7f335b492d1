"""The ``algo`` group's sections: SFT, GRPO (update-many, advantage estimators, group
filtering), PPO's critic and GAE, and the rollout/train mismatch correction; mirrored by
configs/algo/*.yaml."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from polyfsdp.engines.config import OptimConfig
from polyfsdp.engines.losses import AGG_MODES, DEFAULT_CLIP_RATIO_HIGH, KL_TYPES, PPO_AGG_MODES, PPOLoss
from polyfsdp.engines.value_loss import ValueLoss

from .advantages import ADV_ESTIMATORS
from .compose import ConfigError

# Dr. GRPO sums each sequence's token losses and divides by a constant (the generation budget).
DR_GRPO_AGG_MODE = "seq-mean-token-sum-norm"
# Algorithms with an RL phase after the SFT warm-up, and PPO's advantage estimator.
RL_ALGOS = ("grpo", "ppo")
PPO_ADV_ESTIMATORS = ("gae",)


def check_choice(key: str, value: Any, allowed) -> None:
    """ConfigError naming ``key`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{key}: got {value!r}; allowed values: {', '.join(map(str, allowed))}")


def check_min(key: str, value: int, minimum: int) -> None:
    """ConfigError naming ``key`` unless ``value >= minimum``."""
    if value < minimum:
        raise ConfigError(f"{key}: expected an int >= {minimum}, got {value}")


@dataclass
class SFTSection:
    """SFT phase: its optimizer (``optim``, the engine's OptimConfig) and the loss aggregation."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    agg_mode: str = "token-mean"

    def validate(self, where: str) -> None:
        check_choice(f"{where}.agg_mode", self.agg_mode, AGG_MODES)


@dataclass
class GRPOSection:
    """GRPO phase: its optimizer (``optim``), sampling, advantage normalisation, PPO loss
    terms, and how one rollout is split into optimizer steps."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 8
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = DEFAULT_CLIP_RATIO_HIGH
    dual_clip_c: float | None = None
    kl_coef: float = 0.01
    kl_type: str = "k3"
    entropy_coef: float = 0.01
    agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True
    mini_batch_size: int | None = None
    epochs: int = 1
    filter_groups: bool = False
    max_sample_batches: int = 4

    def mini_batches(self, prompts_per_step: int) -> int:
        """Optimizer steps per pass over one rollout."""
        return prompts_per_step // (self.mini_batch_size or prompts_per_step)

    def updates_per_rollout(self, prompts_per_step: int) -> int:
        """Optimizer steps one rollout feeds: epochs x mini-batches."""
        return self.epochs * self.mini_batches(prompts_per_step)

    def validate(self, where: str, prompts_per_step: int, world_size: int) -> None:
        check_min(f"{where}.group_size", self.group_size, 2)
        check_min(f"{where}.max_new_tokens", self.max_new_tokens, 1)
        check_min(f"{where}.epochs", self.epochs, 1)
        check_min(f"{where}.max_sample_batches", self.max_sample_batches, 1)
        if not self.temperature > 0:
            raise ConfigError(f"{where}.temperature: expected > 0, got {self.temperature}")
        check_choice(f"{where}.agg_mode", self.agg_mode, PPO_AGG_MODES)
        check_choice(f"{where}.kl_type", self.kl_type, KL_TYPES)
        size = self.mini_batch_size
        if size is not None:
            check_min(f"{where}.mini_batch_size", size, 1)
            if prompts_per_step % size:
                raise ConfigError(f"{where}.mini_batch_size: must divide trainer.prompts_per_step="
                                  f"{prompts_per_step}, got {size}")
            if size % world_size:
                raise ConfigError(f"{where}.mini_batch_size: must be a multiple of the world size {world_size} "
                                  f"(every rank takes the same optimizer steps), got {size}")


@dataclass
class PPOSection:
    """algo=ppo: the critic (its optimizer ``optim``, value-head init, clipped value loss)
    and GAE. The rollout and the actor's loss are ``algo.grpo``'s."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    gamma: float = 1.0
    lam: float = 1.0
    kl_in_reward: bool = False
    critic_warmup: int = 0
    cliprange_value: float | None = 0.5
    value_agg_mode: str = "token-mean"
    value_head_init_std: float = 0.01
    value_head_path: str | None = None  # a saved head (final/value_head.safetensors of a ppo run)

    def validate(self, where: str) -> None:
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"{where}.{key}: expected a number in [0, 1], got {getattr(self, key)}")
        check_min(f"{where}.critic_warmup", self.critic_warmup, 0)
        check_choice(f"{where}.value_agg_mode", self.value_agg_mode, AGG_MODES)
        if not self.value_head_init_std >= 0:
            raise ConfigError(f"{where}.value_head_init_std: expected >= 0, got {self.value_head_init_std}")
        if self.value_head_path is not None and not os.path.isfile(str(self.value_head_path)):
            raise ConfigError(f"{where}.value_head_path: no such file: {self.value_head_path}")
        try:
            self.value_loss()
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def value_loss(self) -> ValueLoss:
        """The critic's clipped value loss."""
        return ValueLoss(cliprange_value=self.cliprange_value, agg_mode=self.value_agg_mode)


@dataclass
class RolloutCorrectionSection:
    """The sampler's log-probs vs the trainer's: report the mismatch, and optionally weight
    the policy gradient by min(exp(logp_train - logp_rollout), tis_cap)."""

    report_mismatch: bool | str = "auto"  # auto: with a separate sampler (rollout.engine=vllm)
    tis_cap: float | None = None

    def resolve(self, where: str, separate_sampler: bool) -> None:
        """Turn ``report_mismatch: auto`` into True exactly when another engine samples."""
        if self.report_mismatch not in ("auto", True, False):
            raise ConfigError(f"{where}.report_mismatch: expected auto, true or false, got {self.report_mismatch!r}")
        if self.report_mismatch == "auto":
            self.report_mismatch = separate_sampler

    def validate(self, where: str) -> None:
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError(f"{where}.tis_cap: expected > 0 or null, got {self.tis_cap}")

    @property
    def needs_rollout_log_probs(self) -> bool:
        """Whether generation must record the sampler's per-token log-probs."""
        return self.report_mismatch or self.tis_cap is not None


@dataclass
class AlgoSection:
    """``algo=grpo`` (SFT warm-up then GRPO), ``algo=ppo`` (SFT warm-up then PPO with a
    critic: the RL phase keeps GRPO's names and rollout settings) or ``algo=sft`` (SFT only)."""

    name: str = "grpo"
    adv_estimator: str = "grpo"
    sft: SFTSection = field(default_factory=SFTSection)
    grpo: GRPOSection | None = None
    ppo: PPOSection | None = None
    rollout_correction: RolloutCorrectionSection = field(default_factory=RolloutCorrectionSection)

    @property
    def rl(self) -> bool:
        """Whether an RL phase follows the SFT warm-up (grpo or ppo)."""
        return self.name in RL_ALGOS

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL penalty goes into the per-token reward instead of the actor's loss."""
        return self.adv_estimator == "reinforce_plus_plus" or (self.ppo is not None and self.ppo.kl_in_reward)

    def validate_grpo(self, prompts_per_step: int, world_size: int) -> None:
        """The RL settings, together (estimator, loss, correction, PPO's critic)."""
        if self.name == "ppo":
            check_choice("algo.adv_estimator", self.adv_estimator, PPO_ADV_ESTIMATORS)
            if self.ppo is None:
                raise ConfigError("algo.ppo: algo=ppo needs its ppo section (the critic and GAE settings)")
            self.ppo.validate("algo.ppo")
        else:
            check_choice("algo.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        self.grpo.validate("algo.grpo", prompts_per_step, world_size)
        self.rollout_correction.validate("algo.rollout_correction")
        if self.adv_estimator == "dr_grpo" and self.grpo.agg_mode not in ("token-mean", DR_GRPO_AGG_MODE):
            raise ConfigError(f"algo.grpo.agg_mode: adv_estimator=dr_grpo aggregates with {DR_GRPO_AGG_MODE}; "
                              f"leave agg_mode at its default, got {self.grpo.agg_mode!r}")
        try:
            self.ppo_loss(prompts_per_step)
        except ValueError as exc:
            raise ConfigError(f"algo.grpo: {exc}") from None

    def ppo_loss(self, prompts_per_step: int) -> PPOLoss:
        """The PPO loss these settings describe (entropy always reported). With one update
        per rollout the old log-probs are the current ones (ratio == 1), never computed.
        reinforce_plus_plus (and algo.ppo.kl_in_reward) put the KL penalty into the reward,
        so not into the loss."""
        g = self.grpo
        agg_mode = DR_GRPO_AGG_MODE if self.adv_estimator == "dr_grpo" else g.agg_mode
        return PPOLoss(clip_ratio_low=g.clip_ratio_low, clip_ratio_high=g.clip_ratio_high,
                       dual_clip_c=g.dual_clip_c,
                       kl_coef=0.0 if self.kl_in_reward else g.kl_coef,
                       kl_type=g.kl_type, entropy_coef=g.entropy_coef, agg_mode=agg_mode, report_entropy=True,
                       on_policy=g.updates_per_rollout(prompts_per_step) == 1,
                       tis_cap=self.rollout_correction.tis_cap,
                       report_mismatch=self.rollout_correction.report_mismatch,
                       agg_norm_tokens=float(g.max_new_tokens))
