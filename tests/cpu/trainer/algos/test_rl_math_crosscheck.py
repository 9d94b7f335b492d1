"""The five findings of the verl cross-check (issue 25), each against a hand-written reference of
what verl's core_algos computes: a bounded k3, an exact vf_clip_frac, NaN-proof REINFORCE++ token
rewards, one clip-higher default, and group estimators that refuse a group of one."""
from dataclasses import replace

import pytest
import torch
from polyfsdp.trainer.config.composition import compose, to_container

from tests.helpers.loss_cases import loss_inputs_from_sequences
from polyfsdp.engines.losses import DEFAULT_CLIP_RATIO_HIGH, PPOLoss, kl_penalty
from polyfsdp.engines.losses.value import ValueLoss
from polyfsdp.trainer.algos.advantages import group_advantages, reinforce_plus_plus_advantages
from polyfsdp.trainer.config.job import load_config


def _verl_k3(logp, ref):
    """verl's low_var_kl: x = ref - logp clamped to [-20, 20], exp(x) - x - 1 clamped to [-10, 10]."""
    x = torch.clamp(ref - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(x) - x - 1, -10.0, 10.0)


def test_k3_is_bounded_like_verl_and_its_gradient_is_finite():
    ref = torch.tensor([0.0, 0.0, 0.0, 0.0, -0.1])
    logp = torch.tensor([-29.0, -100.0, 95.0, -0.5, -0.2], requires_grad=True)
    kl = kl_penalty(logp, ref, "k3")
    # Bit for bit: _k3 is verl's clamp, exp, subtractions and clamp in the same order (elementwise,
    # so every CPU kernel set rounds both alike); a reordered formula would need float32 rounding.
    assert torch.equal(kl, _verl_k3(logp.detach(), ref))
    assert kl[:2].tolist() == [10.0, 10.0] and kl.isfinite().all()
    kl.sum().backward()
    assert logp.grad.isfinite().all()


def test_vf_clip_frac_counts_no_in_range_prediction_as_clipped():
    # verl's case: old=9.44e-4, v=-8.13e-4, c=0.5 is inside the range, so nothing is clipped.
    inputs = loss_inputs_from_sequences([[-8.13e-4]], {"response_mask": [[1]], "old_values": [[9.44e-4]],
                                                       "returns": [[0.0]]})
    inputs = replace(inputs, log_probs=None, values=inputs.log_probs.clone())
    _, metrics = ValueLoss(cliprange_value=0.5)(inputs)
    assert float(metrics["vf_clip_frac"]) == 0.0


def test_a_nan_kl_off_the_response_leaves_reinforce_pp_advantages_finite():
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0])]
    kl = [torch.tensor([float("nan"), 0.1, 0.2]), torch.tensor([float("nan"), 0.0, 0.3])]
    adv = reinforce_plus_plus_advantages([1.0, 0.0], masks, kl, kl_coef=0.1)
    clean = reinforce_plus_plus_advantages([1.0, 0.0], masks, [torch.where(m > 0, k, 0.0) for k, m in zip(kl, masks)],
                                           kl_coef=0.1)
    assert all(a.isfinite().all() for a in adv)
    assert all(torch.equal(a, b) for a, b in zip(adv, clean))


def test_ppo_loss_and_the_shipped_config_share_one_clip_ratio_high():
    shipped = to_container(compose([]))["algo"]
    # The shipped config leaves the clip range to the policy loss (null): the ppo loss it builds
    # has PPOLoss' own default.
    assert shipped["actor"]["clip_ratio_high"] is None and shipped["actor"]["policy_loss"] == "ppo"
    assert PPOLoss().clip_ratio_high == load_config([]).algo.actor_loss(32).clip_ratio_high == DEFAULT_CLIP_RATIO_HIGH


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_refuse_a_group_of_one(estimator):
    with pytest.raises(ValueError, match="at least 2 completions"):
        group_advantages(torch.tensor([1.0, 0.0]), 1, estimator)
