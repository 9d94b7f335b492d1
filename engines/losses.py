"""Loss functions for the engine's training step: SFT and PPO/GRPO, with KL and entropy terms.

Every loss follows the contract in :mod:`polyfsdp.engines.loss_inputs`: it receives one
micro-batch as flat per-token tensors plus ``offsets`` and the step-wide (all micro-batches,
all ranks) token and sequence counts, and returns ``(loss, metrics)`` with metrics as
detached 0-d tensors (read to the host once per optimizer step, never per micro-batch).

Normalisation is by the GLOBAL counts, so each micro-batch returns its *share* of the
step's loss: summing the shares over micro-batches and ranks gives exactly the loss of the
whole batch, however it was split. The engine must therefore SUM gradients over ranks
(not average them). Metrics are shares in the same sense (token means over the global
response-token count), so the engine sums them over micro-batches and ranks too.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from .loss_inputs import LossInputs

logger = logging.getLogger(__name__)

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# seq-mean-token-sum-norm divides by a constant token count (Dr. GRPO): PPOLoss's agg_norm_tokens.
PPO_AGG_MODES = AGG_MODES + ("seq-mean-token-sum-norm",)
KL_TYPES = ("k1", "k3")
# DAPO's clip-higher: the upper clip bound of PPOLoss and of the shipped algo config (one value).
DEFAULT_CLIP_RATIO_HIGH = 0.28
# exp() of a log-ratio beyond this overflows fp32 long before it carries information;
# the same guard verl applies.
_LOG_RATIO_CLAMP = 20.0
# verl's bounds on the k3 KL estimate (core_algos.kl_penalty, low_var_kl).
K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0
# GSPO (GSPOLoss): verl's default clip range for sequence-level ratios, and its bound on the
# sequence log-ratio.
GSPO_CLIP_RATIO_LOW = 3e-4
GSPO_CLIP_RATIO_HIGH = 4e-4
GSPO_LOG_RATIO_CLAMP = 10.0


# --------------------------------------------------------------------------- segments


def segment_ids(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every flat token, from ``offsets`` (no Python loop, no host sync)."""
    lengths = offsets[1:] - offsets[:-1]
    ids = torch.arange(lengths.numel(), device=offsets.device)
    return torch.repeat_interleave(ids, lengths, output_size=total)


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums ``(num_seqs,)`` of a flat ``(total,)`` tensor."""
    num_seqs = offsets.numel() - 1
    seg = segment_ids(offsets.to(values.device), values.numel())
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seg, values)


def aggregate(values: torch.Tensor, mask: torch.Tensor, inputs: LossInputs, agg_mode: str,
              norm_tokens: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` over ``mask`` into this micro-batch's share of the step loss.

    token-mean: sum / global_num_tokens. seq-mean-token-sum: sum of per-sequence sums /
    global_num_seqs. seq-mean-token-mean: sum of per-sequence means / global_num_seqs
    (a sequence without masked tokens contributes 0 but still counts in global_num_seqs).
    seq-mean-token-sum-norm: sum / (global_num_seqs * norm_tokens), a constant per token.
    """
    masked = values * mask
    if agg_mode == "token-mean":
        return masked.sum() / inputs.global_num_tokens
    if agg_mode == "seq-mean-token-sum-norm":
        if norm_tokens is None:
            raise ValueError("agg_mode seq-mean-token-sum-norm needs norm_tokens (a constant token count)")
        return masked.sum() / (inputs.global_num_seqs * norm_tokens)
    per_seq = segment_sum(masked, inputs.offsets)
    if agg_mode == "seq-mean-token-sum":
        return per_seq.sum() / inputs.global_num_seqs
    if agg_mode == "seq-mean-token-mean":
        counts = segment_sum(mask, inputs.offsets)
        return (per_seq / counts.clamp_min(1.0)).sum() / inputs.global_num_seqs
    raise ValueError(f"unknown agg_mode {agg_mode!r}; choose one of {', '.join(AGG_MODES)}")


def _token_share(values: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Token-mean share of a metric over the global response-token count (a detached 0-d
    tensor: the engine reads metrics to the host once per optimizer step, not per micro-batch)."""
    return (values.detach() * mask).sum() / inputs.global_num_tokens


# --------------------------------------------------------------------------- validation


def _check_agg_mode(agg_mode: str) -> str:
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; choose one of {', '.join(AGG_MODES)}")
    return agg_mode


def _check_inputs(inputs: LossInputs, required: Sequence[str], need_entropy: bool,
                  loss_name: str = "this loss") -> None:
    """Raise ValueError for inputs of the wrong kind or shape, naming the field.

    Shape checks only: they cost no device-to-host read. Values (0/1 masks, finite fields,
    offsets) are checked once per batch at the engine's edge (engines/batch_checks.py).
    """
    if not isinstance(inputs, LossInputs):
        raise TypeError(f"loss functions take a LossInputs, got {type(inputs).__name__}")
    lp = inputs.log_probs
    if not torch.is_tensor(lp) or lp.dim() != 1 or not lp.is_floating_point():
        raise ValueError(
            f"log_probs must be a flat (total_tokens,) float tensor, got "
            f"{type(lp).__name__} {tuple(lp.shape) if torch.is_tensor(lp) else ''} "
            f"{lp.dtype if torch.is_tensor(lp) else ''}".rstrip()
        )
    offsets = inputs.offsets
    if not torch.is_tensor(offsets) or offsets.dim() != 1 or offsets.numel() < 1 or offsets.is_floating_point():
        raise ValueError(f"offsets must be a 1-D integer tensor (num_seqs + 1,), got {offsets!r}")
    missing = [name for name in required if name not in inputs.fields]
    per_seq = inputs.extras.get("seq_fields", {})
    for name in missing:
        if name in per_seq:
            raise ValueError(
                f"batch[{name!r}] has one value per sequence (shape {tuple(per_seq[name].shape)}); "
                f"{loss_name} needs it per token, in input_ids' layout (broadcast it over each sequence)"
            )
    if missing:
        raise ValueError(
            f"loss needs batch fields {list(required)}; missing {missing} (given: {sorted(inputs.fields)})"
        )
    for name in required:
        value = inputs.fields[name]
        if not torch.is_tensor(value) or value.shape != lp.shape:
            given = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(
                f"field {name!r} must have the shape of log_probs {tuple(lp.shape)} "
                f"(flat, same layout), got {given}"
            )
    if need_entropy:
        ent = inputs.entropy
        if ent is None:
            raise ValueError("this loss needs entropy (requires_entropy=True) but inputs.entropy is None")
        if ent.shape != lp.shape:
            raise ValueError(f"entropy must have the shape of log_probs {tuple(lp.shape)}, got {tuple(ent.shape)}")
    if not inputs.global_num_tokens > 0:
        raise ValueError(
            f"global_num_tokens must be > 0 (the step's response-token count), got {inputs.global_num_tokens}"
        )
    if not inputs.global_num_seqs > 0:
        raise ValueError(f"global_num_seqs must be > 0, got {inputs.global_num_seqs}")


# --------------------------------------------------------------------------- KL


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


# --------------------------------------------------------------------------- losses


def is_token_separable(loss_fn) -> bool:
    """Whether ``loss_fn`` declares itself token-separable: a sum over tokens of a function of
    that token's log-prob, entropy and per-token fields, with normalisers fixed before the step
    (global counts, constants), so each token's gradient needs that token alone. The fused head
    then takes the loss gradient inside its forward (engines/fused_logprob_loss.py). The
    declaration (``token_separable = True``) counts only on the loss's own class: a subclass may
    change ``__call__`` and must declare it again."""
    return vars(type(loss_fn)).get("token_separable", False) is True




class SFTLoss:
    """Negative log-likelihood of the tokens selected by ``mask_field`` (the response)."""

    requires_entropy = False
    token_separable = True  # every aggregation mode weights tokens by constants of the step

    def __init__(self, agg_mode: str = "token-mean", mask_field: str = "response_mask"):
        self.agg_mode = _check_agg_mode(agg_mode)
        self.mask_field = mask_field
        self.required_fields = (mask_field,)

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return ``(loss, {"nll": ...})`` for one micro-batch."""
        _check_inputs(inputs, self.required_fields, need_entropy=False, loss_name="SFTLoss")
        log_probs = inputs.log_probs.float()
        mask = inputs.fields[self.mask_field].to(log_probs.dtype)
        loss = aggregate(-log_probs, mask, inputs, self.agg_mode)
        metrics = {"nll": _token_share(-log_probs, mask, inputs)}
        return loss, metrics


class PPOLoss:
    """PPO clipped policy loss (GRPO uses it with group-normalised advantages).

    Per token: ``ratio = exp(logp - old_logp)``, ``pg = max(-A * ratio, -A * clip(ratio,
    1 - clip_ratio_low, 1 + clip_ratio_high))``; with dual-clip (``dual_clip_c > 1``) the
    loss of a negative-advantage token is also capped at ``-A * c``. Adds
    ``kl_coef * KL(policy || ref)`` (k1 or k3) and subtracts ``entropy_coef * entropy``.
    ``on_policy``: old log-probs are the current ones, detached (one update per rollout).
    ``report_mismatch`` reads ``rollout_log_probs`` (the sampler's) and reports how far they
    are from the old ones; ``tis_cap`` also weights each token's policy-gradient term by
    ``min(exp(old - rollout), tis_cap)`` (truncated importance sampling).
    """

    # Clipping, dual-clip, TIS weights, k1/k3 and the entropy bonus are per token; the
    # aggregation weights are constants of the step (is_token_separable).
    token_separable = True

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
        if tis_cap is not None and not tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0 (or None to disable), got {tis_cap}")
        self.on_policy = on_policy
        self.tis_cap = tis_cap
        self.report_mismatch = report_mismatch or tis_cap is not None
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
        _check_inputs(inputs, self.required_fields, need_entropy=self.requires_entropy,
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
        metrics["approx_kl"] = _token_share(old - log_probs, mask, inputs)

        if self.kl_coef > 0.0:
            ref = fields["ref_log_probs"].to(log_probs.dtype)
            kl = kl_penalty(log_probs, ref, self.kl_type)
            kl_loss = aggregate(kl, mask, inputs, self.agg_mode, self.agg_norm_tokens)
            loss = loss + self.kl_coef * kl_loss
            metrics["kl"] = kl_loss.detach()
        if self.requires_entropy:
            entropy = inputs.entropy.float()
            metrics["entropy"] = _token_share(entropy, mask, inputs)
            if self.entropy_coef != 0.0:
                loss = loss - self.entropy_coef * aggregate(entropy, mask, inputs, self.agg_mode, self.agg_norm_tokens)
        return loss, metrics

    def _policy_gradient(self, inputs: LossInputs, log_probs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                         mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped policy-gradient term's share of the step loss and its metrics: per token,
        aggregated with ``agg_mode`` (a subclass may change what one term is, e.g. GSPOLoss)."""
        log_ratio = torch.clamp(log_probs - old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        loss_unclipped = -adv * ratio
        loss_clipped = -adv * torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        pg = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped  # = (A > 0, ratio > 1 + high) or (A < 0, ratio < 1 - low)
        metrics = _clip_metrics(clipped, adv, ratio, mask, inputs)
        if self.dual_clip_c is not None:
            cap = -adv * self.dual_clip_c
            negative = adv < 0
            metrics["clip_frac_lower"] = _token_share(((pg > cap) & negative).float(), mask, inputs)
            pg = torch.where(negative, torch.minimum(pg, cap), pg)
        if self.tis_cap is not None:
            # Truncated importance sampling: the rollout came from the sampler's
            # distribution, the gradient is taken under the trainer's.
            rollout = inputs.fields["rollout_log_probs"].to(log_probs.dtype)
            weight = torch.clamp(torch.exp(torch.clamp(old - rollout, max=_LOG_RATIO_CLAMP)), max=self.tis_cap)
            metrics["tis_weight_mean"] = _token_share(weight, mask, inputs)
            pg = pg * weight.detach()
        return aggregate(pg, mask, inputs, self.agg_mode, self.agg_norm_tokens), metrics


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
    entropy terms are PPOLoss's, aggregated with ``agg_mode``. Dual-clip and TIS are not
    defined for it. The paper's clip ranges are ~1e-4 (sequence ratios stay close to 1).
    """

    token_separable = False  # s_i couples the tokens of a sequence

    def __init__(self, clip_ratio_low: float = GSPO_CLIP_RATIO_LOW, clip_ratio_high: float = GSPO_CLIP_RATIO_HIGH,
                 sequence_level: bool = True, agg_mode: str = "seq-mean-token-mean", **kwargs):
        for key in ("dual_clip_c", "tis_cap"):
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
        return pg_loss, _clip_metrics(clipped, adv, ratio, mask, inputs)


def _clip_metrics(clipped: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor,
                  inputs: LossInputs) -> dict[str, torch.Tensor]:
    """Clip fractions (all, A > 0 at the upper bound, A < 0 at the lower) and the ratio's mean
    and max over the response tokens."""
    return {"clip_frac": _token_share(clipped.float(), mask, inputs),
            "clip_frac_high": _token_share((clipped & (adv > 0)).float(), mask, inputs),
            "clip_frac_low": _token_share((clipped & (adv < 0)).float(), mask, inputs),
            "ratio_mean": _token_share(ratio, mask, inputs),
            "ratio_max": _masked_max(ratio, mask)}


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest non-negative ``values`` over ``mask`` (0 without masked tokens). Metric names
    ending in ``_max`` are reduced by maximum, not summed, in the engine."""
    return torch.where(mask > 0, values.detach(), torch.zeros_like(values)).max() if values.numel() else \
        torch.zeros((), device=values.device)


def _mismatch_metrics(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                      inputs: LossInputs) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's for the same tokens: mean and
    max |difference| and the k3 estimate of KL(sampler || trainer) (samples are the sampler's)."""
    diff = (train - rollout).detach()
    return {"rollout_mismatch_abs_mean": _token_share(diff.abs(), mask, inputs),
            "rollout_mismatch_abs_max": _masked_max(diff.abs(), mask),
            "rollout_mismatch_kl": _token_share(_k3(diff), mask, inputs)}
