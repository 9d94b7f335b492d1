"""Loss functions against hand-computed values on tiny tensors (engines/losses/)."""
import math

import pytest
import torch

from polyfsdp.engines.losses.inputs import LossInputs
from polyfsdp.engines.losses import (
    AGG_MODES,
    PPOLoss,
    SFTLoss,
    segment_sum,
)

from tests.helpers.loss_cases import loss_inputs_from_sequences



def _symmetric_ppo(**kwargs) -> PPOLoss:
    """The hand-computed PPO values below use the symmetric clip 1 +- 0.2 (PPOLoss's default upper
    bound is DAPO's 0.28, as in the shipped config)."""
    return PPOLoss(clip_ratio_high=0.2, **kwargs)


# ---------------------------------------------------------------- SFT

SFT_LP = [[-1.0, -2.0, -3.0, 0.0], [-0.5, 0.0]]
SFT_MASK = [[1, 1, 0, 0], [1, 0]]


@pytest.mark.parametrize(
    "agg_mode, expected",
    [
        ("token-mean", (1.0 + 2.0 + 0.5) / 3),  # 3 response tokens
        ("seq-mean-token-sum", ((1.0 + 2.0) + 0.5) / 2),  # 2 sequences
        ("seq-mean-token-mean", ((1.0 + 2.0) / 2 + 0.5 / 1) / 2),
    ],
)
def test_sft_nll_matches_hand_computed_value_for_each_agg_mode(agg_mode, expected):
    inputs = loss_inputs_from_sequences(SFT_LP, {"response_mask": SFT_MASK})
    loss, metrics = SFTLoss(agg_mode=agg_mode)(inputs)
    assert loss.item() == pytest.approx(expected, abs=1e-7)
    assert metrics["nll"] == pytest.approx(3.5 / 3, abs=1e-7)


def test_sft_mask_as_bool_int_or_float_gives_the_same_loss():
    losses = []
    for dtype in (torch.bool, torch.long, torch.float32):
        inputs = loss_inputs_from_sequences(SFT_LP, {"response_mask": SFT_MASK})
        inputs.fields["response_mask"] = inputs.fields["response_mask"].to(dtype)
        losses.append(SFTLoss()(inputs)[0].item())
    assert losses[0] == losses[1] == losses[2] == pytest.approx(3.5 / 3, abs=1e-7)


# ---------------------------------------------------------------- PPO
# Response tokens (ratio, advantage) and their clipped PPO losses with eps = 0.2:
#   a: (1.5, +1): max(-1.5, -1.2) = -1.2   clipped
#   b: (0.5, -1): max( 0.5,  0.8) =  0.8   clipped
#   c: (1.1, +2): max(-2.2, -2.2) = -2.2
#   d: (0.5, +1): max(-0.5, -0.8) = -0.5
#   e: (5.0, -1): max( 5.0,  1.2) =  5.0   (dual-clip with c = 3 caps it at 3.0)
# Masked positions get extreme values that must not leak into anything.
RATIOS = [[1.5, 0.5, 40.0], [1.1, 0.5, 5.0, 1e-3]]
ADV = [[1.0, -1.0, 7.0], [2.0, 1.0, -1.0, -9.0]]
MASK = [[1, 1, 0], [1, 1, 1, 0]]
OLD = [[-1.0, -2.0, -0.5], [-0.3, -1.5, -4.0, -2.0]]
PG_TOKENS = [[-1.2, 0.8], [-2.2, -0.5, 5.0]]
PG_TOKENS_DUAL = [[-1.2, 0.8], [-2.2, -0.5, 3.0]]


def _ppo_inputs(**extra_fields):
    log_probs = [[o + math.log(r) for o, r in zip(os_, rs)] for os_, rs in zip(OLD, RATIOS)]
    fields = {"response_mask": MASK, "old_log_probs": OLD, "advantages": ADV, **extra_fields}
    return loss_inputs_from_sequences(log_probs, fields)


def _expected(per_seq_tokens, agg_mode):
    if agg_mode == "token-mean":
        return sum(sum(s) for s in per_seq_tokens) / sum(len(s) for s in per_seq_tokens)
    if agg_mode == "seq-mean-token-sum":
        return sum(sum(s) for s in per_seq_tokens) / len(per_seq_tokens)
    return sum(sum(s) / len(s) for s in per_seq_tokens) / len(per_seq_tokens)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_ppo_clipped_loss_matches_hand_computed_value_for_each_agg_mode(agg_mode):
    loss, metrics = _symmetric_ppo(agg_mode=agg_mode)(_ppo_inputs())
    assert loss.item() == pytest.approx(_expected(PG_TOKENS, agg_mode), abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(loss.item(), abs=1e-7)
    assert metrics["clip_frac"] == pytest.approx(2 / 5, abs=1e-7)  # tokens a and b
    kl_old_new = -sum(math.log(r) for r in (1.5, 0.5, 1.1, 0.5, 5.0)) / 5
    assert metrics["approx_kl"] == pytest.approx(kl_old_new, abs=1e-6)
    assert "entropy" not in metrics and "kl" not in metrics


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_ppo_dual_clip_caps_negative_advantage_tokens(agg_mode):
    loss, metrics = _symmetric_ppo(dual_clip_c=3.0, agg_mode=agg_mode)(_ppo_inputs())
    assert loss.item() == pytest.approx(_expected(PG_TOKENS_DUAL, agg_mode), abs=1e-6)
    assert metrics["clip_frac_lower"] == pytest.approx(1 / 5, abs=1e-7)  # token e only


def test_ppo_asymmetric_clip_uses_high_bound_for_ratio_above_one():
    # clip_ratio_high = 0.6 lets token a (ratio 1.5, A=+1) through unclipped: -1.5.
    loss, metrics = PPOLoss(clip_ratio_low=0.2, clip_ratio_high=0.6)(_ppo_inputs())
    assert loss.item() == pytest.approx((-1.5 + 0.8 - 2.2 - 0.5 + 5.0) / 5, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(1 / 5, abs=1e-7)


def test_ppo_gradient_flows_only_through_unclipped_response_tokens():
    inputs = _ppo_inputs()
    inputs.log_probs.requires_grad_(True)
    loss, _ = _symmetric_ppo()(inputs)
    loss.backward()
    # d(-A * ratio)/d logp = -A * ratio, divided by the 5 response tokens.
    expected = [0.0, 0.0, 0.0, -2.0 * 1.1 / 5, -1.0 * 0.5 / 5, 1.0 * 5.0 / 5, 0.0]
    assert inputs.log_probs.grad.tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_kl_penalty_k1_and_k3_match_hand_computed_values(kl_type):
    # logp - ref per response token (masked positions get a huge gap that must be ignored).
    gaps = [[0.5, -1.0, 30.0], [0.0, 0.2, -0.3, 30.0]]
    inputs = _ppo_inputs()
    lp = inputs.log_probs.tolist()
    flat_gaps = [g for s in gaps for g in s]
    inputs.fields["ref_log_probs"] = torch.tensor([p - g for p, g in zip(lp, flat_gaps)])
    response_gaps = [0.5, -1.0, 0.0, 0.2, -0.3]
    if kl_type == "k1":
        per_token = response_gaps
    else:  # exp(ref - logp) - (ref - logp) - 1
        per_token = [math.exp(-g) + g - 1.0 for g in response_gaps]
    expected_kl = sum(per_token) / 5
    loss, metrics = _symmetric_ppo(kl_coef=0.1, kl_type=kl_type)(inputs)
    assert metrics["kl"] == pytest.approx(expected_kl, abs=1e-6)
    assert loss.item() == pytest.approx(_expected(PG_TOKENS, "token-mean") + 0.1 * expected_kl, abs=1e-6)


def test_entropy_bonus_subtracts_coef_times_mean_entropy():
    entropy = [[1.0, 2.0, 100.0], [0.5, 0.25, 0.25, 100.0]]
    inputs = _ppo_inputs()
    inputs.entropy = torch.tensor([e for s in entropy for e in s])
    loss_fn = _symmetric_ppo(entropy_coef=0.01)
    assert loss_fn.requires_entropy
    loss, metrics = loss_fn(inputs)
    mean_entropy = (1.0 + 2.0 + 0.5 + 0.25 + 0.25) / 5
    assert metrics["entropy"] == pytest.approx(mean_entropy, abs=1e-7)
    assert loss.item() == pytest.approx(_expected(PG_TOKENS, "token-mean") - 0.01 * mean_entropy, abs=1e-6)


def test_required_fields_and_entropy_flag_follow_the_coefficients():
    assert PPOLoss().required_fields == ("response_mask", "old_log_probs", "advantages")
    assert "ref_log_probs" in PPOLoss(kl_coef=0.05).required_fields
    assert not PPOLoss().requires_entropy
    assert PPOLoss(report_entropy=True).requires_entropy
    assert not SFTLoss().requires_entropy and SFTLoss().required_fields == ("response_mask",)


# ---------------------------------------------------------------- split invariance


def _random_batch(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    seqs = {k: [] for k in ("lp", "old", "ref", "adv", "mask", "ent")}
    for n in lengths:
        mask = (torch.rand(n, generator=g) > 0.3).long()
        mask[-1] = 0
        seqs["mask"].append(mask)
        seqs["lp"].append(-torch.rand(n, generator=g) * 3)
        seqs["old"].append(-torch.rand(n, generator=g) * 3)
        seqs["ref"].append(-torch.rand(n, generator=g) * 3)
        seqs["adv"].append(torch.randn(n, generator=g).expand(n).clone())
        seqs["ent"].append(torch.rand(n, generator=g) * 2)
    return seqs


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_sum_of_micro_batch_losses_with_global_counts_equals_whole_batch_loss(agg_mode):
    lengths = [5, 1, 7, 3, 4, 6]
    s = _random_batch(0, lengths)
    total_tokens = float(sum(int(m.sum()) for m in s["mask"]))
    loss_fn = _symmetric_ppo(dual_clip_c=3.0, kl_coef=0.1, entropy_coef=0.01, agg_mode=agg_mode)

    def run(lo, hi):
        inputs = loss_inputs_from_sequences(
            [t.clone().requires_grad_(True) for t in s["lp"][lo:hi]],
            {"response_mask": s["mask"][lo:hi], "old_log_probs": s["old"][lo:hi],
             "ref_log_probs": s["ref"][lo:hi], "advantages": s["adv"][lo:hi]},
            entropy=s["ent"][lo:hi], global_num_tokens=total_tokens, global_num_seqs=len(lengths),
        )
        inputs.log_probs = inputs.log_probs.detach().requires_grad_(True)
        loss, metrics = loss_fn(inputs)
        loss.backward()
        return loss.item(), metrics, inputs.log_probs.grad

    whole_loss, whole_metrics, whole_grad = run(0, 6)
    parts = [run(0, 2), run(2, 3), run(3, 6)]
    assert sum(p[0] for p in parts) == pytest.approx(whole_loss, abs=1e-6)
    torch.testing.assert_close(torch.cat([p[2] for p in parts]), whole_grad, atol=1e-7, rtol=0)
    for key, value in whole_metrics.items():
        # Shares add up; *_max metrics are maxima (the engine reduces them by max).
        combine = max if key.endswith("_max") else sum
        assert float(combine(p[1][key] for p in parts)) == pytest.approx(float(value), abs=1e-6), key


def test_segment_sum_handles_empty_sequences():
    offsets = torch.tensor([0, 0, 3, 3, 5])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert segment_sum(values, offsets).tolist() == [0.0, 6.0, 0.0, 9.0]


# ---------------------------------------------------------------- bad input


def test_unknown_agg_mode_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown agg_mode 'mean'.*token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        PPOLoss(agg_mode="mean")
    with pytest.raises(ValueError, match="unknown agg_mode"):
        SFTLoss(agg_mode="sum")


def test_bad_constructor_arguments_are_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        PPOLoss(dual_clip_c=1.0)
    with pytest.raises(ValueError, match=r"unknown kl_type 'k9'.*k1, k3"):
        PPOLoss(kl_type="k9")
    with pytest.raises(ValueError, match="clip_ratio_low"):
        PPOLoss(clip_ratio_low=1.5)


def test_mask_of_wrong_length_or_layout_is_rejected():
    inputs = _ppo_inputs()
    inputs.fields["response_mask"] = inputs.fields["response_mask"][:-1]
    with pytest.raises(ValueError, match=r"'response_mask' must have the shape of log_probs \(7,\).*got \(6,\)"):
        PPOLoss()(inputs)
    inputs = _ppo_inputs()
    inputs.fields["advantages"] = torch.zeros(2, 4)  # dense (B, L) instead of flat
    with pytest.raises(ValueError, match=r"'advantages' must have the shape of log_probs \(7,\).*got \(2, 4\)"):
        PPOLoss()(inputs)


def test_missing_fields_for_the_chosen_loss_are_named():
    inputs = _ppo_inputs()
    with pytest.raises(ValueError, match=r"missing \['ref_log_probs'\]"):
        PPOLoss(kl_coef=0.1)(inputs)
    with pytest.raises(ValueError, match="inputs.entropy is None"):
        PPOLoss(entropy_coef=0.01)(inputs)


def test_zero_global_token_count_is_rejected():
    inputs = _ppo_inputs()
    inputs.global_num_tokens = 0.0
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        PPOLoss()(inputs)


def test_loss_inputs_type_is_checked():
    with pytest.raises(TypeError, match="LossInputs"):
        SFTLoss()({"log_probs": torch.zeros(3)})
    assert isinstance(_ppo_inputs(), LossInputs)


def _tis_inputs(rollout_gaps):
    """Two response tokens with ratio 1 (log_probs == old) and advantages +1, -1;
    rollout_log_probs = old - gap (the sampler gave the token a different log-prob)."""
    old = [[-1.0, -0.5, -2.0, 0.0]]
    rollout = [[o - g for o, g in zip(old[0], rollout_gaps)]]
    fields = {"response_mask": [[0.0, 1.0, 1.0, 0.0]], "old_log_probs": old, "advantages": [[0.0, 1.0, -1.0, 0.0]],
              "rollout_log_probs": rollout}
    return loss_inputs_from_sequences(old, fields)


def test_truncated_importance_sampling_weights_the_policy_gradient_by_the_capped_ratio():
    # Token 1: exp(old - rollout) = exp(1.0) = 2.72, capped at 2. Token 2: exp(-0.5) = 0.61.
    gaps = [0.0, 1.0, -0.5, 0.0]
    inputs = _tis_inputs(gaps)
    inputs.log_probs.requires_grad_(True)
    loss, metrics = PPOLoss(tis_cap=2.0)(inputs)
    w1, w2 = 2.0, math.exp(-0.5)
    assert loss.item() == pytest.approx((-1.0 * w1 + 1.0 * w2) / 2, abs=1e-6)
    loss.backward()
    assert inputs.log_probs.grad.tolist() == pytest.approx([0.0, -w1 / 2, w2 / 2, 0.0], abs=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx((w1 + w2) / 2, abs=1e-6)
    assert metrics["rollout_mismatch_abs_mean"] == pytest.approx(0.75, abs=1e-6)
    assert metrics["rollout_mismatch_abs_max"] == pytest.approx(1.0, abs=1e-6)
    # k3 of KL(sampler || trainer) per token: exp(d) - 1 - d with d = train - rollout.
    expected_kl = ((math.exp(1.0) - 2.0) + (math.exp(-0.5) - 0.5)) / 2
    assert metrics["rollout_mismatch_kl"] == pytest.approx(expected_kl, abs=1e-6)
    # Without the cap the loss is the plain one; with equal log-probs the weights are 1.
    assert PPOLoss(report_mismatch=True)(_tis_inputs(gaps))[0].item() == pytest.approx(0.0, abs=1e-7)
    same = PPOLoss(tis_cap=2.0)(_tis_inputs([0.0] * 4))[1]
    assert same["tis_weight_mean"] == pytest.approx(1.0) and same["rollout_mismatch_abs_max"] == 0.0


def test_on_policy_loss_reads_no_old_log_probs_and_has_ratio_one():
    loss_fn = PPOLoss(on_policy=True)
    assert "old_log_probs" not in loss_fn.required_fields
    inputs = _tis_inputs([0.0] * 4)
    inputs.fields["old_log_probs"] = torch.full_like(inputs.log_probs, 99.0)  # ignored
    loss, metrics = loss_fn(inputs)
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_frac"] == 0.0 and loss.item() == 0.0


def test_seq_mean_token_sum_norm_divides_by_a_constant_token_count():
    loss, _ = _symmetric_ppo(agg_mode="seq-mean-token-sum-norm", agg_norm_tokens=4.0)(_ppo_inputs())
    assert loss.item() == pytest.approx(sum(sum(s) for s in PG_TOKENS) / (len(PG_TOKENS) * 4.0), abs=1e-6)
    with pytest.raises(ValueError, match="agg_norm_tokens"):
        PPOLoss(agg_mode="seq-mean-token-sum-norm")
