"""PPO's clipped policy loss (GRPO uses it with group-normalised advantages) and GSPO's
sequence-level variant, with the KL penalty and the clip, ratio and sampler-mismatch metrics.

Both follow the loss contract (engines/losses/inputs.py) and aggregate through
engines/losses/aggregation.py; ``from polyfsdp.engines.losses import PPOLoss`` keeps working.
"""
from __future__ import annotations

import torch

from .aggregation import AGG_MODES, aggregate, segment_ids, segment_sum, token_share
from .correction import LOG_RATIO_CLAMP, behaviour_weight, check_correction
from .inputs import LossInputs, check_inputs

# seq-mean-token-sum-norm divides by a constant token count (Dr. GRPO): PPOLoss's agg_norm_tokens.
PPO_AGG_MODES = AGG_MODES + ("seq-mean-token-sum-norm",)
KL_TYPES = ("k1", "k3")
# DAPO's clip-higher: the upper clip bound of PPOLoss and of the shipped algo config (one value).
DEFAULT_CLIP_RATIO_HIGH = 0.28
# verl's bounds on the k3 KL estimate (core_algos.kl_penalty, low_var_kl).
K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0
# GSPO (GSPOLoss): verl's default clip range for sequence-level ratios, and its bound on the
# sequence log-ratio.
GSPO_CLIP_RATIO_LOW = 3e-4
GSPO_CLIP_RATIO_HIGH = 4e-4
GSPO_LOG_RATIO_CLAMP = 10.0


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = exp(x) - x - 1 for x = log q - log p, with verl's bounds: x clamped to
    [-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND] and the estimate to [-K3_BOUND, K3_BOUND], so one
    far-off token cannot give an inf loss (fp32 exp overflows above ~88.7) or a NaN gradient."""
    x = torch.clamp(log_ratio, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(x) - x - 1.0, -K3_BOUND, K3_BOUND)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate: k1 = logp - ref; k3 = exp(ref - logp) - (ref - logp) - 1
    (bounded, see :func:`_k3`)."""
    if kl_type == "k1":
        return log_probs - ref_log_probs
    if kl_type == "k3":
        return _k3(ref_log_probs - log_probs)
    raise ValueError(f"unknown kl_type {kl_type!r}; choose one of {', '.join(KL_TYPES)}")



class PPOLoss:
    """PPO clipped policy loss (GRPO uses it with group-normalised advantages).

    Per token: ``ratio = exp(logp - old_logp)``, ``pg = max(-A * ratio, -A * clip(ratio,
    1 - clip_ratio_low, 1 + clip_ratio_high))``; with dual-clip (``dual_clip_c > 1``) the
    loss of a negative-advantage token is also capped at ``-A * c``. Adds
    ``kl_coef * KL(policy || ref)`` (k1 or k3) and subtracts ``entropy_coef * entropy``.
    ``on_policy``: old log-probs are the current ones, detached (one update per rollout).
    ``report_mismatch`` reads ``rollout_log_probs`` (the sampler's) and reports how far they
    are from the old ones. The behaviour-policy correction (engines/losses/correction.py) weights
    each token's policy-gradient term with ``r = exp(old - rollout)``: ``tis_cap`` by ``min(r,
    tis_cap)`` (truncated importance sampling), ``mask_low`` / ``mask_high`` by 0 where ``r`` (per
    token, or the sequence's geometric mean with ``mask_level="sequence"``) lies outside the
    bounds (masked importance sampling); a masked token is a weight of 0, the normalisation by the
    step's token and sequence counts is unchanged. Either implies ``report_mismatch``.
    """

    # Clipping, dual-clip, TIS weights and token masks, k1/k3 and the entropy bonus are per
    # token; the aggregation weights are constants of the step (is_token_separable). A
    # sequence-level mask on policy reads the current log-probs of the whole sequence: that
    # instance opts out (self.token_separable = False, see __init__).
    token_separable = True
    # Every term and metric is weighted by response_mask (or a torch.where on it); the log-ratio
    # and k3 clamps keep the products finite where the head wrote 0 (engines/head/rows.py).
    masked_positions_only = True

    def __init__(
        self,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = DEFAULT_CLIP_RATIO_HIGH,
        dual_clip_c: float | None = None,
        kl_coef: float = 0.0,
        kl_type: str = "k3",
        entropy_coef: float = 0.0,
        agg_mode: str = "token-mean",
        report_entropy: bool = False,
        on_policy: bool = False,
        tis_cap: float | None = None,
        report_mismatch: bool = False,
        agg_norm_tokens: float | None = None,
        mask_low: float | None = None,
        mask_high: float | None = None,
        mask_level: str = "token",
    ):
        if not 0.0 <= clip_ratio_low < 1.0:
            raise ValueError(f"clip_ratio_low must lie in [0, 1), got {clip_ratio_low}")
        if not clip_ratio_high >= 0.0:
            raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
        if dual_clip_c is not None and not dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
        if not kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if kl_type not in KL_TYPES:
            raise ValueError(f"unknown kl_type {kl_type!r}; choose one of {', '.join(KL_TYPES)}")
        check_correction(tis_cap, mask_low, mask_high, mask_level)
        self.on_policy = on_policy
        self.tis_cap = tis_cap
        self.mask_low, self.mask_high, self.mask_level = mask_low, mask_high, mask_level
        masks = mask_low is not None or mask_high is not None
        self.report_mismatch = report_mismatch or tis_cap is not None or masks
        if masks and mask_level == "sequence" and on_policy:
            # old = the current log-probs: a token's weight depends on its sequence's other
            # tokens, which the fused head has not computed yet when it takes this token's gradient.
            self.token_separable = False
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.dual_clip_c = dual_clip_c
        self.kl_coef = kl_coef
        self.kl_type = kl_type
        self.entropy_coef = entropy_coef
        if agg_mode not in PPO_AGG_MODES:
            raise ValueError(f"unknown agg_mode {agg_mode!r}; choose one of {', '.join(PPO_AGG_MODES)}")
        if agg_mode == "seq-mean-token-sum-norm" and not (agg_norm_tokens or 0) > 0:
            raise ValueError(f"agg_mode seq-mean-token-sum-norm needs agg_norm_tokens > 0, got {agg_norm_tokens}")
        self.agg_mode = agg_mode
        self.agg_norm_tokens = agg_norm_tokens
        # Entropy costs a vocab-wide pass; ask for it only when it changes the loss or is reported.
        self.requires_entropy = entropy_coef != 0.0 or report_entropy
        # on_policy: one update per rollout, so the sampling policy IS the current one and
        # old_log_probs would equal log_probs (ratio == 1); the loss uses log_probs.detach().
        fields = ["response_mask"] + ([] if on_policy else ["old_log_probs"]) + ["advantages"]
        if kl_coef > 0.0:
            fields.append("ref_log_probs")
        if self.report_mismatch:
            fields.append("rollout_log_probs")
        self.required_fields = tuple(fields)

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return ``(loss, metrics)``: pg_loss, clip fractions, ratio mean/max, approx_kl,
        [clip_frac_lower], [kl], [entropy], [rollout_mismatch_*, tis_weight_mean]."""
        check_inputs(inputs, self.required_fields, need_entropy=self.requires_entropy,
                      loss_name=type(self).__name__)
        fields = inputs.fields
        log_probs = inputs.log_probs.float()
        mask = fields["response_mask"].to(log_probs.dtype)
        old = log_probs.detach() if self.on_policy else fields["old_log_probs"].to(log_probs.dtype)
        adv = fields["advantages"].to(log_probs.dtype)

        pg_loss, metrics = self._policy_gradient(inputs, log_probs, old, adv, mask)
        if self.report_mismatch:
            metrics.update(_mismatch_metrics(old, fields["rollout_log_probs"].to(log_probs.dtype), mask, inputs))
        loss = pg_loss
        metrics["pg_loss"] = pg_loss.detach()
        # k1 estimate of KL(old || new), the usual PPO diagnostic.
        metrics["approx_kl"] = token_share(old - log_probs, mask, inputs)

        if self.kl_coef > 0.0:
            ref = fields["ref_log_probs"].to(log_probs.dtype)
            kl = kl_penalty(log_probs, ref, self.kl_type)
            kl_loss = aggregate(kl, mask, inputs, self.agg_mode, self.agg_norm_tokens)
            loss = loss + self.kl_coef * kl_loss
            metrics["kl"] = kl_loss.detach()
        if self.requires_entropy:
            entropy = inputs.entropy.float()
            metrics["entropy"] = token_share(entropy, mask, inputs)
            if self.entropy_coef != 0.0:
                loss = loss - self.entropy_coef * aggregate(entropy, mask, inputs, self.agg_mode, self.agg_norm_tokens)
        return loss, metrics

    def _policy_gradient(self, inputs: LossInputs, log_probs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                         mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped policy-gradient term's share of the step loss and its metrics: per token,
        aggregated with ``agg_mode`` (a subclass may change what one term is, e.g. GSPOLoss)."""
        log_ratio = torch.clamp(log_probs - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        loss_unclipped = -adv * ratio
        loss_clipped = -adv * torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        pg = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped  # = (A > 0, ratio > 1 + high) or (A < 0, ratio < 1 - low)
        metrics = clip_metrics(clipped, adv, ratio, mask, inputs)
        if self.dual_clip_c is not None:
            cap = -adv * self.dual_clip_c
            negative = adv < 0
            metrics["clip_frac_lower"] = token_share(((pg > cap) & negative).float(), mask, inputs)
            pg = torch.where(negative, torch.minimum(pg, cap), pg)
        pg = self.behaviour_corrected(pg, inputs, old, mask, metrics)
        return aggregate(pg, mask, inputs, self.agg_mode, self.agg_norm_tokens), metrics

    def behaviour_corrected(self, pg: torch.Tensor, inputs: LossInputs, old: torch.Tensor, mask: torch.Tensor,
                            metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token ``pg`` weighted by the behaviour-policy correction (TIS cap, masks; the
        rollout came from the sampler's distribution, the gradient is taken under the trainer's),
        its metrics added to ``metrics``; ``pg`` itself without one. A subclass replacing
        ``_policy_gradient`` calls it to honour ``tis_cap`` and the masks."""
        if self.tis_cap is None and self.mask_low is None and self.mask_high is None:
            return pg
        rollout = inputs.fields["rollout_log_probs"].to(old.dtype)
        weight, extra = behaviour_weight(old, rollout, mask, inputs, self.tis_cap, self.mask_low, self.mask_high,
                                         self.mask_level)
        metrics.update(extra)
        return pg * weight


class GSPOLoss(PPOLoss):
    """GSPO's clipped policy loss (Zheng et al., 2025, "Group Sequence Policy Optimization"):
    one importance ratio per SEQUENCE, ``s_i = exp(mean over i's response tokens of (logp -
    old_logp))``, clipped like PPO's, ``pg_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - low, 1 +
    high))`` with ``A_i`` the mean of the sequence's token advantages, and the step loss the
    mean of ``pg_i`` over the step's sequences (a sequence without response tokens adds 0).
    Every token's gradient depends on its whole sequence, so this is not a sum of per-token
    terms (not token-separable: the fused head keeps today's path).

    ``sequence_level=False`` is GSPO-token: per-token terms with ``s_i,t = sg[s_i] *
    exp(logp_t - sg[logp_t])`` (value s_i, gradient s_i * d logp_t) and per-token advantages,
    aggregated with ``agg_mode`` (verl's "gspo"); with one advantage per sequence and
    seq-mean-token-mean it equals the sequence-level loss in value and gradient. The KL and
    entropy terms are PPOLoss's, aggregated with ``agg_mode``. Dual-clip, TIS and the masks of
    the behaviour correction are not defined for it. The paper's clip ranges are ~1e-4
    (sequence ratios stay close to 1).
    """

    token_separable = False  # s_i couples the tokens of a sequence
    masked_positions_only = True  # s_i averages (logp - old) over the response mask only

    def __init__(self, clip_ratio_low: float = GSPO_CLIP_RATIO_LOW, clip_ratio_high: float = GSPO_CLIP_RATIO_HIGH,
                 sequence_level: bool = True, agg_mode: str = "seq-mean-token-mean", **kwargs):
        for key in ("dual_clip_c", "tis_cap", "mask_low", "mask_high"):
            if kwargs.get(key) is not None:
                raise ValueError(f"{key} applies to the per-token ppo policy loss, not to GSPO; leave it null")
        super().__init__(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, agg_mode=agg_mode, **kwargs)
        self.sequence_level = sequence_level

    def _policy_gradient(self, inputs: LossInputs, log_probs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                         mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        offsets = inputs.offsets.to(log_probs.device)
        seq = segment_ids(offsets, log_probs.numel())
        tokens = segment_sum(mask, offsets)
        seq_log_ratio = segment_sum((log_probs - old) * mask, offsets) / tokens.clamp_min(1.0)
        # verl's bound on the sequence log-ratio (exp stays finite far beyond any clip range).
        seq_log_ratio = torch.clamp(seq_log_ratio, max=GSPO_LOG_RATIO_CLAMP)
        if self.sequence_level:
            ratio = torch.exp(seq_log_ratio)
            seq_adv = segment_sum(adv * mask, offsets) / tokens.clamp_min(1.0)
            unclipped = -seq_adv * ratio
            clipped_loss = -seq_adv * torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
            pg = torch.maximum(unclipped, clipped_loss) * (tokens > 0)
            pg_loss = pg.sum() / inputs.global_num_seqs
            # Metrics per token (shares like PPOLoss'): each token carries its sequence's values.
            clipped, ratio, adv = (clipped_loss > unclipped)[seq], ratio[seq], seq_adv[seq]
        else:
            ratio = torch.exp(seq_log_ratio.detach()[seq] + log_probs - log_probs.detach())
            unclipped = -adv * ratio
            clipped_loss = -adv * torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
            pg_loss = aggregate(torch.maximum(unclipped, clipped_loss), mask, inputs, self.agg_mode,
                                self.agg_norm_tokens)
            clipped = clipped_loss > unclipped
        return pg_loss, clip_metrics(clipped, adv, ratio, mask, inputs)


def clip_metrics(clipped: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor,
                  inputs: LossInputs) -> dict[str, torch.Tensor]:
    """Clip fractions (all, A > 0 at the upper bound, A < 0 at the lower) and the ratio's mean
    and max over the response tokens."""
    return {"clip_frac": token_share(clipped.float(), mask, inputs),
            "clip_frac_high": token_share((clipped & (adv > 0)).float(), mask, inputs),
            "clip_frac_low": token_share((clipped & (adv < 0)).float(), mask, inputs),
            "ratio_mean": token_share(ratio, mask, inputs),
            "ratio_max": _masked_max(ratio, mask)}


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest non-negative ``values`` over ``mask`` (0 without masked tokens). Metric names
    ending in ``_max`` are reduced by maximum, not summed, in the engine."""
    return torch.where(mask > 0, values.detach(), torch.zeros_like(values)).max() if values.numel() else \
        torch.zeros((), device=values.device)


def _mismatch_metrics(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                      inputs: LossInputs) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's for the same tokens: mean and
    max |difference| and the k3 estimate of KL(sampler || trainer) (samples are the sampler's).
    The k3 is bounded like verl's (:func:`_k3`: log-ratio to +-20, the estimate to +-10): unbounded,
    one token at a log-ratio of 25 reads exp(25) = 7e10 and swamps the mean on a dashboard (issue 38);
    the worst token's size stays visible, unbounded, as ``rollout_mismatch_abs_max``."""
    diff = (train - rollout).detach()
    return {"rollout_mismatch_abs_mean": token_share(diff.abs(), mask, inputs),
            "rollout_mismatch_abs_max": _masked_max(diff.abs(), mask),
            "rollout_mismatch_kl": token_share(_k3(diff), mask, inputs)}
