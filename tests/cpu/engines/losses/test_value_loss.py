"""ValueLoss (engines/losses/value.py) against hand-computed values on tiny tensors."""
from dataclasses import replace

import pytest
import torch

from tests.helpers.loss_cases import loss_inputs_from_sequences
from polyfsdp.engines.losses.value import ValueLoss

# cliprange_value = 0.2. Response tokens (prediction v, rollout value v_old, return R):
#   a: (1.0, 0.5, 2.0)   v_clipped = 0.7:  max((1-2)^2, (0.7-2)^2)   = 1.69  clipped
#   b: (0.5, 0.5, 0.0)   v_clipped = 0.5:  max(0.25, 0.25)           = 0.25
#   c: (-1.0, 0.0, -1.5) v_clipped = -0.2: max(0.25, (-0.2+1.5)^2)   = 1.69  clipped
# Masked positions hold extreme values that must not leak into anything.
VPRED = [[1.0, 0.5, 9.0], [-1.0, 0.0]]
OLD = [[0.5, 0.5, -7.0], [0.0, 0.0]]
RETURNS = [[2.0, 0.0, 50.0], [-1.5, 3.0]]
MASK = [[1, 1, 0], [1, 0]]


def _inputs(vpred=VPRED):
    inputs = loss_inputs_from_sequences(vpred, {"response_mask": MASK, "old_values": OLD, "returns": RETURNS})
    values = inputs.log_probs.clone().requires_grad_(True)
    return replace(inputs, log_probs=None, values=values)


@pytest.mark.parametrize("agg_mode, expected", [
    ("token-mean", 0.5 * (1.69 + 0.25 + 1.69) / 3),
    ("seq-mean-token-sum", 0.5 * ((1.69 + 0.25) + 1.69) / 2),
    ("seq-mean-token-mean", 0.5 * ((1.69 + 0.25) / 2 + 1.69) / 2),
])
def test_clipped_value_loss_matches_hand_computed_values(agg_mode, expected):
    loss, metrics = ValueLoss(cliprange_value=0.2, agg_mode=agg_mode)(_inputs())
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["vf_loss"].item() == pytest.approx(expected, abs=1e-6)
    assert metrics["vf_clip_frac"].item() == pytest.approx(2 / 3, abs=1e-7)
    assert metrics["vpred_mean"].item() == pytest.approx((1.0 + 0.5 - 1.0) / 3, abs=1e-7)


def test_gradient_flows_only_through_the_unclipped_tokens():
    inputs = _inputs()
    loss, _ = ValueLoss(cliprange_value=0.2)(inputs)
    loss.backward()
    # a and c take the clipped term, whose clamp is saturated: no gradient. b: d/dv 0.5*(v-R)^2/3 = 0.5/3.
    assert torch.allclose(inputs.values.grad, torch.tensor([0.0, 0.5 / 3, 0.0, 0.0, 0.0]), atol=1e-7)


def test_without_clipping_it_is_half_the_squared_error():
    loss, metrics = ValueLoss(cliprange_value=None)(_inputs())
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.25 + 0.25) / 3, abs=1e-7)
    assert metrics["vf_clip_frac"].item() == 0.0


def test_a_prediction_inside_the_clip_range_is_not_clipped():
    # Negative control: every prediction within 0.2 of its rollout value -> the plain loss.
    near = [[0.6, 0.5, 9.0], [-0.1, 0.0]]
    clipped, metrics = ValueLoss(cliprange_value=0.2)(_inputs(near))
    plain, _ = ValueLoss(cliprange_value=None)(_inputs(near))
    assert clipped.item() == pytest.approx(plain.item(), abs=1e-7) and metrics["vf_clip_frac"].item() == 0.0


def test_bad_settings_and_inputs_raise_one_line_errors():
    with pytest.raises(ValueError, match="cliprange_value"):
        ValueLoss(cliprange_value=0.0)
    with pytest.raises(ValueError, match="agg_mode"):
        ValueLoss(agg_mode="seq-mean-token-sum-norm")
    policy_inputs = loss_inputs_from_sequences(VPRED, {"response_mask": MASK, "old_values": OLD, "returns": RETURNS})
    with pytest.raises(ValueError, match="value head"):
        ValueLoss()(policy_inputs)
    missing = replace(_inputs(), fields={"response_mask": _inputs().fields["response_mask"]})
    with pytest.raises(ValueError, match="missing"):
        ValueLoss()(missing)
