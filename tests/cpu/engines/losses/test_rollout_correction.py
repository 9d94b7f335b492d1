"""The behaviour-policy correction of PPOLoss (engines/losses/correction.py): truncated and masked
importance sampling against a float64 reference written out here with plain loops (value and
gradient), and the fused head's loss-in-forward path with the masks."""
from __future__ import annotations

import math

import pytest
import torch

from polyfsdp.engines.head.fused import fused_logprob_entropy
from polyfsdp.engines.losses import GSPOLoss, LossInputs, PPOLoss, is_token_separable

from tests.cpu.engines.head.test_fused_logprob_loss import _assert_same, _batch, _run

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
# A jagged micro-batch: (prompt positions, response positions) per sequence; the last position
# of every sequence is outside the response, one sequence has no response token at all.
SHAPES = [(2, 5), (1, 1), (3, 0), (1, 7), (2, 3)]
EXTRA_TOKENS, EXTRA_SEQS = 4.0, 2  # the step's other micro-batches: the normalisers are global


def _jagged(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [p + r + 1 for p, r in SHAPES]
    n = sum(lengths)
    mask = torch.cat([torch.tensor([0.0] * p + [1.0] * r + [0.0]) for p, r in SHAPES]).double()
    log_probs = -0.3 - torch.rand(n, generator=g, dtype=torch.float64)
    old = log_probs + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)  # ratios inside and outside the clip
    # Behaviour log-ratios old - rollout spread over [-1.5, 1.5]: some tokens beyond each bound.
    rollout = old - (3.0 * torch.rand(n, generator=g, dtype=torch.float64) - 1.5)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return log_probs, old, rollout, adv, mask, offsets


def _inputs(log_probs, old, rollout, adv, mask, offsets):
    fields = {"response_mask": mask, "old_log_probs": old, "rollout_log_probs": rollout, "advantages": adv}
    return LossInputs(log_probs=log_probs, entropy=None, fields=fields, offsets=offsets,
                      global_num_tokens=float(mask.sum()) + EXTRA_TOKENS,
                      global_num_seqs=offsets.numel() - 1 + EXTRA_SEQS)


def _reference(log_probs, old, rollout, adv, mask, offsets, agg_mode, tis_cap, low, high, level):
    """The corrected PPO policy-gradient loss, token by token in float64."""
    total_tokens, total_seqs = float(mask.sum()) + EXTRA_TOKENS, offsets.numel() - 1 + EXTRA_SEQS
    loss = torch.zeros((), dtype=torch.float64)
    for s in range(offsets.numel() - 1):
        positions = [t for t in range(int(offsets[s]), int(offsets[s + 1])) if mask[t] == 1.0]
        if not positions:
            continue
        seq_ratio = math.exp(sum(float(old[t] - rollout[t]) for t in positions) / len(positions))
        terms = []
        for t in positions:
            ratio = torch.exp(log_probs[t] - old[t])
            a = float(adv[t])
            term = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - CLIP_LOW, 1.0 + CLIP_HIGH))
            r = math.exp(float(old[t] - rollout[t]))
            weight = min(r, tis_cap) if tis_cap is not None else 1.0
            judged = r if level == "token" else seq_ratio
            if (low is not None and judged < low) or (high is not None and judged > high):
                weight = 0.0
            terms.append(term * weight)
        if agg_mode == "token-mean":
            loss = loss + sum(terms) / total_tokens
        else:  # seq-mean-token-mean
            loss = loss + sum(terms) / len(terms) / total_seqs
    return loss


def _masked_share(old, rollout, mask, offsets, low, high, level):
    masked = 0
    for s in range(offsets.numel() - 1):
        positions = [t for t in range(int(offsets[s]), int(offsets[s + 1])) if mask[t] == 1.0]
        seq_log = sum(float(old[t] - rollout[t]) for t in positions) / max(len(positions), 1)
        for t in positions:
            judged = math.exp(float(old[t] - rollout[t]) if level == "token" else seq_log)
            masked += (low is not None and judged < low) or (high is not None and judged > high)
    return masked / (float(mask.sum()) + EXTRA_TOKENS)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("tis_cap", [None, 1.5])
@pytest.mark.parametrize("level,low,high", [("token", 0.5, 2.0), ("token", None, 1.8), ("token", 0.6, None),
                                            ("sequence", 0.8, 1.25), ("sequence", None, 1.1)])
def test_masked_importance_sampling_matches_a_float64_reference(agg_mode, tis_cap, level, low, high):
    log_probs, old, rollout, adv, mask, offsets = _jagged()
    expected_share = _masked_share(old, rollout, mask, offsets, low, high, level)
    assert 0.0 < expected_share < float(mask.sum()) / (float(mask.sum()) + EXTRA_TOKENS)  # some masked, not all
    lp_ref = log_probs.clone().requires_grad_()
    expected = _reference(lp_ref, old, rollout, adv, mask, offsets, agg_mode, tis_cap, low, high, level)
    expected.backward()

    lp = log_probs.clone().requires_grad_()
    loss_fn = PPOLoss(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, agg_mode=agg_mode, tis_cap=tis_cap,
                      mask_low=low, mask_high=high, mask_level=level)
    assert "rollout_log_probs" in loss_fn.required_fields
    loss, metrics = loss_fn(_inputs(lp, old, rollout, adv, mask, offsets))
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-5, atol=1e-7)
    assert metrics["mis_masked_frac"].item() == pytest.approx(expected_share, rel=1e-6)
    assert ("tis_weight_mean" in metrics) == (tis_cap is not None)


def test_without_bounds_the_correction_is_todays_tis_and_no_mask_metric():
    log_probs, old, rollout, adv, mask, offsets = _jagged(1)
    for tis_cap in (None, 1.5):
        lp_ref = log_probs.clone().requires_grad_()
        expected = _reference(lp_ref, old, rollout, adv, mask, offsets, "token-mean", tis_cap, None, None, "token")
        loss, metrics = PPOLoss(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, tis_cap=tis_cap)(
            _inputs(log_probs.clone(), old, rollout, adv, mask, offsets))
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
        assert "mis_masked_frac" not in metrics


def test_a_masked_token_keeps_its_place_in_the_normalisation():
    # Two response tokens, both ratio 1 against old, advantages +1 and +1; the second is 3x more
    # likely under the trainer than under the sampler and is masked: the loss is -1 / 2, not -1 / 1.
    zero = torch.zeros(4, dtype=torch.float64)
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    rollout = torch.tensor([0.0, 0.0, -math.log(3.0), 0.0], dtype=torch.float64)
    inputs = LossInputs(log_probs=zero.clone(), entropy=None, offsets=torch.tensor([0, 4]), global_num_tokens=2.0,
                        global_num_seqs=1, fields={"response_mask": mask, "old_log_probs": zero, "advantages": mask,
                                                   "rollout_log_probs": rollout})
    loss, metrics = PPOLoss(mask_high=2.0)(inputs)
    assert loss.item() == pytest.approx(-0.5) and metrics["mis_masked_frac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs,message", [
    ({"mask_low": 0.0}, "mask_low must be > 0"), ({"mask_high": -1.0}, "mask_high must be > 0"),
    ({"mask_low": 2.0, "mask_high": 2.0}, "mask_low must be below mask_high"),
    ({"mask_level": "geometric"}, "unknown mask_level 'geometric'; choose one of token, sequence"),
])
def test_impossible_mask_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PPOLoss(**kwargs)


@pytest.mark.parametrize("key", ["mask_low", "mask_high"])
def test_gspo_refuses_the_masks_like_tis(key):
    with pytest.raises(ValueError, match=f"{key} applies to the per-token ppo policy loss, not to GSPO"):
        GSPOLoss(**{key: 1.5})


def _bounds_around_the_median(level, on_policy):
    """Bounds that mask part of the fused-head batch: outside the middle half of its behaviour
    log-ratios (per token, or the sequences' means)."""
    hidden, weight, labels, offsets, fields, temperature = _batch()
    old = fused_logprob_entropy(hidden, weight, labels, temperature=temperature)[0] if on_policy else \
        fields["old_log_probs"]
    gap, mask = old - fields["rollout_log_probs"], fields["response_mask"]
    if level == "token":
        values = gap[mask > 0]
    else:
        values = torch.stack([gap[a:b][mask[a:b] > 0].mean() for a, b in zip(offsets[:-1], offsets[1:])
                              if mask[a:b].sum() > 0])
    return math.exp(torch.quantile(values, 0.25).item()), math.exp(torch.quantile(values, 0.75).item())


@pytest.mark.parametrize("on_policy,level", [(False, "token"), (True, "token"), (False, "sequence")])
def test_the_fused_head_takes_masked_losses_whose_weights_are_per_token(on_policy, level):
    low, high = _bounds_around_the_median(level, on_policy)
    loss_fn = PPOLoss(tis_cap=2.0, mask_low=low, mask_high=high, mask_level=level, on_policy=on_policy,
                      agg_mode="seq-mean-token-mean")
    assert is_token_separable(loss_fn)
    fused = _run(loss_fn, True, "eager", "per_token", None)
    assert 0.0 < fused[1]["mis_masked_frac"].item()
    _assert_same(fused, _run(loss_fn, False, "eager", "per_token", None))


def test_a_sequence_mask_on_policy_is_not_token_separable():
    # Its weights read the current log-probs of the whole sequence: taken inside the fused head,
    # whose rows beyond the current chunk are not computed yet, the gradient would be wrong.
    low, high = _bounds_around_the_median("sequence", True)
    loss_fn = PPOLoss(mask_low=low, mask_high=high, mask_level="sequence", on_policy=True)
    assert not is_token_separable(loss_fn)
    forced = _run(loss_fn, True, "eager", "per_token", None)  # what the opt-out keeps it from
    today = _run(loss_fn, False, "eager", "per_token", None)
    assert not torch.allclose(forced[2], today[2], rtol=1e-3, atol=1e-3 * float(today[2].abs().max()))
    assert is_token_separable(PPOLoss(mask_low=0.5, mask_level="sequence"))
    assert is_token_separable(PPOLoss(on_policy=True, mask_level="sequence"))  # no bound: nothing masked
