"""The ``algo`` group's sections: SFT, the RL phase's actor (rollout, policy loss,
update-many, group filtering), the critic and GAE of the critic estimators, and the
rollout/train mismatch correction; mirrored by configs/algo/*.yaml. Which estimator and
policy loss need what is declared with them (trainer/algos/estimators.py, trainer/algos/policy_losses.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polyfsdp.engines.config import OptimConfig, setting

from ..errors import ConfigError
from .bounds import MAX_BATCH, MAX_GROUP_SIZE, MAX_TOKENS
from .sampling import SamplingControls

if TYPE_CHECKING:
    from polyfsdp.engines.losses import PPOLoss
    from polyfsdp.engines.losses.value import ValueLoss

    from ..algos.estimators import Estimator
    from ..algos.policy_losses import UserLoss
# The losses, estimators and policy losses (torch) are imported where a section is checked or
# used: declaring the sections (--help, a mistyped key) stays free of torch.

# algo presets with an RL phase after the SFT warm-up (configs/algo/<name>.yaml).
RL_ALGOS = ("grpo", "ppo")


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

    optim: OptimConfig = setting(OptimConfig, doc="the SFT phase's AdamW and schedule")
    agg_mode: str = setting("token-mean", doc="token-mean | seq-mean-token-sum | seq-mean-token-mean")

    def validate(self, where: str) -> None:
        from polyfsdp.engines.losses import AGG_MODES

        check_choice(f"{where}.agg_mode", self.agg_mode, AGG_MODES)


@dataclass
class ActorSection(SamplingControls):
    """The RL phase's policy: its optimizer (``optim``), sampling (temperature and the
    controls of :class:`SamplingControls`), advantage normalisation, the policy loss and its
    terms, and how one rollout is split into optimizer steps."""

    optim: OptimConfig = setting(OptimConfig, doc="the policy's AdamW and schedule")
    group_size: int = setting(8, doc="completions sampled per prompt", high=MAX_GROUP_SIZE)
    # Sampling divides logits by it: below 1e-3 float32 logits overflow, above 1e3 it is noise.
    temperature: float = setting(1.0, doc="sampling temperature", low=1e-3, high=1e3)
    max_new_tokens: int = setting(8, doc="tokens per completion (per turn)", high=MAX_TOKENS)
    policy_loss: str = setting("ppo", doc="ppo | gspo | gspo_token, or path/to/file.py:NAME / "
                                          "package.module:NAME (trainer/algos/policy_losses.py)")
    clip_ratio_low: float | None = setting(None, doc="null: the policy loss's default (ppo 0.2, gspo 3e-4)")
    clip_ratio_high: float | None = setting(None, doc="null: the policy loss's default (ppo 0.28, gspo 4e-4)")
    dual_clip_c: float | None = setting(None, doc="dual-clip PPO's c; null: off")
    kl_coef: float = setting(0.01, doc="weight of the KL to the reference")
    kl_type: str = setting("k3", doc="k1 | k3")
    entropy_coef: float = setting(0.01, doc="weight of the entropy bonus")
    agg_mode: str = setting("token-mean", doc="token-mean | seq-mean-token-sum | seq-mean-token-mean | "
                                              "seq-mean-token-sum-norm")
    norm_adv_by_std: bool = setting(True, doc="GRPO: (r - mean) / std within each group")
    mini_batch_size: int | None = setting(None, doc="prompts per optimizer step, all ranks; null: "
                                                    "prompts_per_step", high=MAX_BATCH)
    epochs: int = setting(1, doc="passes over each rollout", high=1024)
    filter_groups: bool = setting(False, doc="DAPO dynamic sampling: drop groups whose rewards are all equal, "
                                             "resample")
    max_sample_batches: int = setting(4, doc="with filter_groups: at most this many sampling rounds per step",
                                      high=1024)

    def mini_batches(self, prompts_per_step: int) -> int:
        """Optimizer steps per pass over one rollout."""
        return prompts_per_step // (self.mini_batch_size or prompts_per_step)

    def updates_per_rollout(self, prompts_per_step: int) -> int:
        """Optimizer steps one rollout feeds: epochs x mini-batches."""
        return self.epochs * self.mini_batches(prompts_per_step)

    def validate(self, where: str, prompts_per_step: int, world_size: int) -> None:
        from polyfsdp.engines.losses import KL_TYPES, PPO_AGG_MODES

        from ..algos.policy_losses import policy_loss_entry

        check_min(f"{where}.group_size", self.group_size, 2)
        check_min(f"{where}.max_new_tokens", self.max_new_tokens, 1)
        check_min(f"{where}.epochs", self.epochs, 1)
        check_min(f"{where}.max_sample_batches", self.max_sample_batches, 1)
        if not self.temperature > 0:
            raise ConfigError(f"{where}.temperature: expected > 0, got {self.temperature}")
        self.validate_sampling(where)
        check_choice(f"{where}.agg_mode", self.agg_mode, PPO_AGG_MODES)
        policy_loss_entry(self.policy_loss, f"{where}.policy_loss")
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
class CriticSection:
    """A critic estimator's (gae, algo=ppo): the critic (its optimizer ``optim``, value-head
    init, clipped value loss, warm-up) and GAE's discounts. The rollout and the actor's loss
    are ``algo.actor``'s."""

    optim: OptimConfig = setting(OptimConfig, doc="the critic's AdamW and schedule")
    gamma: float = setting(1.0, doc="discount per response token")
    lam: float = setting(1.0, doc="GAE lambda (1: Monte-Carlo returns minus the value baseline)")
    kl_in_reward: bool = setting(False, doc="true: -kl_coef * (logp_old - logp_ref) per token in the reward, "
                                            "not in the loss")
    critic_warmup: int = setting(0, doc="RL steps that train only the critic before the actor starts")
    cliprange_value: float | None = setting(0.5, doc="clipped value loss around the rollout's values; null: no "
                                                     "clipping")
    value_agg_mode: str = setting("token-mean", doc="token-mean | seq-mean-token-sum | seq-mean-token-mean")
    value_head_init_std: float = setting(0.01, doc="the scalar head's N(0, std) weights, zero bias")
    value_head_path: str | None = setting(None, doc="or a saved head: final/value_head.safetensors of a ppo run")

    def validate(self, where: str) -> None:
        from polyfsdp.engines.losses import AGG_MODES

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
        from polyfsdp.engines.losses.value import ValueLoss

        return ValueLoss(cliprange_value=self.cliprange_value, agg_mode=self.value_agg_mode)


# tis_cap=auto with rollout.max_staleness > 0: verl's default threshold of token-level TIS.
ASYNC_TIS_CAP = 2.0


def auto_tis_cap(max_staleness: int, per_token_corrections: bool) -> float | None:
    """What ``tis_cap: auto`` means: :data:`ASYNC_TIS_CAP` when the samples are off policy
    (``rollout.max_staleness > 0``) and the actor's policy loss takes per-token corrections,
    else None (off)."""
    return ASYNC_TIS_CAP if max_staleness > 0 and per_token_corrections else None


@dataclass
class RolloutCorrectionSection:
    """The sampler's log-probs vs the trainer's: report the mismatch, and optionally correct the
    policy gradient with the behaviour ratio r = exp(logp_train - logp_rollout): weight each
    token by min(r, tis_cap), and mask (weight 0) a token, or a whole sequence by its geometric
    mean ratio, whose r lies outside [mask_low, mask_high] (engines/losses/correction.py)."""

    report_mismatch: bool | str = setting("auto", doc="log |logp_rollout - logp_train| and KL (auto: with a "
                                                       "separate sampler or rollout.max_staleness > 0)")
    tis_cap: float | str | None = setting("auto", doc="truncated importance sampling: weight min(r, cap); null: "
                                                      "off (auto: 2.0 with rollout.max_staleness > 0 and "
                                                      "policy_loss=ppo)")
    mask_low: float | None = setting(None, doc="masked importance sampling: weight 0 where r < mask_low")
    mask_high: float | None = setting(None, doc="... where r > mask_high")
    mask_level: str = setting("token", doc="token | sequence (the geometric mean r masks all its tokens)")

    def resolve(self, where: str, separate_sampler: bool, max_staleness: int = 0,
                per_token_corrections: bool = True) -> None:
        """Turn ``report_mismatch: auto`` into True exactly when another engine samples or the
        samples are stale, and ``tis_cap: auto`` into :func:`auto_tis_cap`'s value."""
        if self.report_mismatch not in ("auto", True, False):
            raise ConfigError(f"{where}.report_mismatch: expected auto, true or false, got {self.report_mismatch!r}")
        if isinstance(self.tis_cap, str) and self.tis_cap != "auto":
            raise ConfigError(f"{where}.tis_cap: expected auto, a number > 0 or null, got {self.tis_cap!r}")
        if self.report_mismatch == "auto":
            self.report_mismatch = separate_sampler or max_staleness > 0
        if self.tis_cap == "auto":
            self.tis_cap = auto_tis_cap(max_staleness, per_token_corrections)

    def validate(self, where: str) -> None:
        from polyfsdp.engines.losses import MASK_LEVELS

        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError(f"{where}.tis_cap: expected > 0 or null, got {self.tis_cap}")
        for key in ("mask_low", "mask_high"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ConfigError(f"{where}.{key}: expected > 0 or null, got {getattr(self, key)}")
        if self.mask_low is not None and self.mask_high is not None and not self.mask_low < self.mask_high:
            raise ConfigError(f"{where}.mask_low: must be below {where}.mask_high={self.mask_high}, "
                              f"got {self.mask_low}")
        check_choice(f"{where}.mask_level", self.mask_level, MASK_LEVELS)

    @property
    def masks(self) -> bool:
        """Whether a bound of masked importance sampling is set."""
        return self.mask_low is not None or self.mask_high is not None

    @property
    def corrections(self) -> dict:
        """The policy loss's keywords of the behaviour correction (the mask options only when a
        bound is set: a user's loss class written before them need not take them)."""
        masks = {"mask_low": self.mask_low, "mask_high": self.mask_high, "mask_level": self.mask_level}
        return {"tis_cap": self._tis_cap, **(masks if self.masks else {})}

    @property
    def _tis_cap(self) -> float | None:
        """The cap; ``auto`` left unresolved (a section built in Python, not by build_job_config,
        which knows the run's staleness) means a synchronous run's: none."""
        return auto_tis_cap(0, True) if self.tis_cap == "auto" else self.tis_cap

    @property
    def needs_rollout_log_probs(self) -> bool:
        """Whether generation must record the sampler's per-token log-probs."""
        return bool(self.report_mismatch) or self._tis_cap is not None or self.masks


@dataclass
class DistillSection:
    """On-policy distillation (trainer/algos/distill/): with a ``teacher`` checkpoint directory,
    each response token's advantage is ``task_weight * A_task - coef * (log pi_student -
    log pi_teacher)`` on the student's own sampled tokens (``task_weight=0``: pure distillation)."""

    teacher: str | None = setting(None, doc="a Hugging Face checkpoint directory with the student's tokenizer; "
                                            "null: off")
    coef: float = setting(1.0, doc="weight of the per-token reverse KL in the advantage")
    task_weight: float = setting(1.0, doc="weight of the task's advantage; 0: pure distillation")

    @property
    def enabled(self) -> bool:
        return self.teacher is not None

    def validate(self, where: str, rl: bool) -> None:
        for key in ("coef", "task_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"{where}.{key}: expected >= 0, got {getattr(self, key)}")
        if not self.enabled:
            if (self.coef, self.task_weight) != (DistillSection.coef, DistillSection.task_weight):
                raise ConfigError(f"{where}.coef / task_weight: apply with a teacher; set {where}.teacher=DIR")
            return
        if not rl:
            raise ConfigError(f"{where}.teacher: distillation trains on the RL phase's samples; algo=sft has none "
                              f"(use algo=grpo, with trainer.sft_steps=0 to start from the initial model)")
        if not os.path.isdir(str(self.teacher)):
            raise ConfigError(f"{where}.teacher: {self.teacher!r} is not a directory (a Hugging Face checkpoint "
                              f"with its tokenizer, e.g. the final/ of a polyfsdp run)")
        if not os.path.isfile(os.path.join(str(self.teacher), "config.json")):
            raise ConfigError(f"{where}.teacher: {self.teacher} holds no model (no config.json); expected a Hugging "
                              f"Face checkpoint directory with its tokenizer, e.g. the final/ of a polyfsdp run")
        if self.coef == 0 and self.task_weight == 0:
            raise ConfigError(f"{where}.coef and {where}.task_weight are both 0: no advantage is left to train on")


@dataclass
class AlgoSection:
    """``algo=grpo`` (SFT warm-up then RL with a group estimator), ``algo=ppo`` (the same with
    the critic estimator gae and its ``critic`` section) or ``algo=sft`` (SFT only). What the
    RL phase computes follows from ``adv_estimator`` and ``actor.policy_loss``."""

    name: str = setting("grpo", doc="grpo | ppo | sft: the preset chosen with algo=NAME")
    adv_estimator: str = setting("grpo", doc="grpo | dr_grpo | rloo | reinforce_plus_plus | gae, or "
                                             "path/to/file.py:NAME (trainer/algos/estimators.py)")
    sft: SFTSection = setting(SFTSection, doc="the SFT phase")
    actor: ActorSection | None = setting(None, doc="the RL phase's policy (algo=grpo, ppo)")
    critic: CriticSection | None = setting(None, doc="a critic estimator's critic (algo=ppo)")
    rollout_correction: RolloutCorrectionSection = setting(RolloutCorrectionSection, doc="sampler vs trainer "
                                                                                         "log-probs")
    distill: DistillSection = setting(DistillSection, doc="on-policy distillation")

    @property
    def rl(self) -> bool:
        """Whether an RL phase follows the SFT warm-up."""
        return self.name in RL_ALGOS

    @property
    def estimator(self) -> Estimator:
        """The registered (or user's) estimator ``adv_estimator`` names."""
        from ..algos.estimators import resolve_estimator

        return resolve_estimator(self.adv_estimator)

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL penalty goes into the per-token reward instead of the actor's loss."""
        est = self.estimator
        return est.kl_in_reward or (est.needs_critic and self.critic is not None and self.critic.kl_in_reward)

    def needs_old_log_probs(self, actor_loss, has_reference: bool) -> bool:
        """The one rule for computing the rollout's old log-probs: a loss off policy (one update
        per rollout is on policy: ratio == 1, the loss uses its own log-probs), an estimator that
        reads them, the KL in the reward (logp_old - logp_ref, when there is a reference), or a
        distillation teacher (the student's log-probs of its reverse KL)."""
        return (not actor_loss.on_policy or self.estimator.needs_old_log_probs
                or (self.kl_in_reward and has_reference) or self.distill.enabled)

    def validate_rl(self, prompts_per_step: int, world_size: int) -> None:
        """The RL settings, together (estimator, critic, policy loss, correction)."""
        from ..algos.policy_losses import POLICY_LOSSES, check_on_a_made_up_batch, policy_loss_entry
        from .plugins import first_line

        est = self.estimator
        if est.needs_critic and self.critic is None:
            raise ConfigError(f"algo.adv_estimator: {self.adv_estimator} learns a critic, which needs the algo.critic "
                              f"section: use algo=ppo (or algo=ppo algo.adv_estimator={self.adv_estimator})")
        if not est.needs_critic and self.critic is not None:
            raise ConfigError(f"algo.adv_estimator: got {self.adv_estimator!r}, which uses no critic, but "
                              f"algo={self.name} configures one (algo.critic); use algo=grpo for it, or a critic "
                              f"estimator (gae)")
        if self.critic is not None:
            self.critic.validate("algo.critic")
        self.actor.validate("algo.actor", prompts_per_step, world_size)
        self.rollout_correction.validate("algo.rollout_correction")
        loss = policy_loss_entry(self.actor.policy_loss)
        if est.agg_mode and loss.agg_mode and est.agg_mode != loss.agg_mode:
            raise ConfigError(f"algo.actor.policy_loss: adv_estimator={self.adv_estimator} aggregates with "
                              f"{est.agg_mode}, policy_loss={loss.name} with {loss.agg_mode}; choose another pair")
        for who, mode in ((f"adv_estimator={self.adv_estimator}", est.agg_mode),
                          (f"policy_loss={loss.name}", loss.agg_mode)):
            if mode and self.actor.agg_mode not in ("token-mean", mode):
                raise ConfigError(f"algo.actor.agg_mode: {who} aggregates with {mode}; leave agg_mode at its "
                                  f"default, got {self.actor.agg_mode!r}")
        if not loss.per_token_corrections:
            rc = self.rollout_correction
            for key, value in (("algo.actor.dual_clip_c", self.actor.dual_clip_c),
                               ("algo.rollout_correction.tis_cap", rc.tis_cap),
                               ("algo.rollout_correction.mask_low", rc.mask_low),
                               ("algo.rollout_correction.mask_high", rc.mask_high)):
                if value is not None:
                    raise ConfigError(f"{key}: applies to the per-token ppo policy loss, not to policy_loss="
                                      f"{loss.name}; leave it null")
        builtin = self.actor.policy_loss in POLICY_LOSSES
        try:
            actor_loss = self.actor_loss(prompts_per_step)
        except ValueError as exc:
            raise ConfigError(f"algo.actor: {exc}") from None
        except Exception as exc:  # a user's loss class, e.g. one not taking PPOLoss' keywords
            if builtin:
                raise
            raise ConfigError(f"algo.actor.policy_loss={self.actor.policy_loss}: {loss.loss_class.__name__}(...) "
                              f"raised {type(exc).__name__}: {first_line(exc)}; it must take PPOLoss' keyword "
                              f"arguments (and the entry's options)") from None
        if not builtin:
            check_on_a_made_up_batch(actor_loss)

    def actor_loss(self, prompts_per_step: int) -> PPOLoss | UserLoss:
        """The policy loss these settings describe (entropy always reported). With one update
        per rollout the old log-probs are the current ones (ratio == 1), never computed. An
        estimator with the KL in the reward (reinforce_plus_plus, algo.critic.kl_in_reward)
        takes it out of the loss. A user's loss comes wrapped: its failures are one line."""
        from ..algos.policy_losses import POLICY_LOSSES, policy_loss_entry, wrap_user_loss

        g = self.actor
        entry = policy_loss_entry(g.policy_loss)
        agg_mode = self.estimator.agg_mode or entry.agg_mode or g.agg_mode
        corrections = {"dual_clip_c": g.dual_clip_c, **self.rollout_correction.corrections} \
            if entry.per_token_corrections else {}
        loss = entry(
            clip_ratio_low=entry.clip_ratio_low if g.clip_ratio_low is None else g.clip_ratio_low,
            clip_ratio_high=entry.clip_ratio_high if g.clip_ratio_high is None else g.clip_ratio_high,
            kl_coef=0.0 if self.kl_in_reward else g.kl_coef, kl_type=g.kl_type, entropy_coef=g.entropy_coef,
            agg_mode=agg_mode, report_entropy=True, on_policy=g.updates_per_rollout(prompts_per_step) == 1,
            report_mismatch=self.rollout_correction.report_mismatch, agg_norm_tokens=float(g.max_new_tokens),
            **corrections)
        return loss if g.policy_loss in POLICY_LOSSES else wrap_user_loss(loss, g.policy_loss)
