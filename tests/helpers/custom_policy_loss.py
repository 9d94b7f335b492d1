"""A user's own policy losses, outside polyfsdp: ``algo.actor.policy_loss=PATH/custom_policy_loss.py:NAME``
(tests/cpu/trainer/algos/test_user_policy_loss.py checks them against the built-in and a float64 reference, and
runs them through polyfsdp-train). Each is a PPOLoss subclass replacing ``_policy_gradient`` and its
PolicyLoss entry; the other names are the mistakes a user makes."""
import torch

from polyfsdp.engines.losses import LOG_RATIO_CLAMP, PPOLoss, aggregate, clip_metrics, token_share
from polyfsdp.trainer.algos.policy_losses import PolicyLoss

CALLS: list[str] = []  # one entry per micro-batch the job's loss saw, for the end-to-end test


class PPOAgain(PPOLoss):
    """PPO's clipped per-token ratio, dual-clip and TIS written out again from the formula."""

    token_separable = True  # per-token terms: the fused head may take its gradient, as for PPOLoss

    def _policy_gradient(self, inputs, log_probs, old, adv, mask):
        ratio = torch.exp(torch.clamp(log_probs - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        unclipped = -adv * ratio
        clipped_loss = -adv * torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        pg = torch.maximum(unclipped, clipped_loss)
        metrics = clip_metrics(clipped_loss > unclipped, adv, ratio, mask, inputs)
        if self.dual_clip_c is not None:
            cap = -adv * self.dual_clip_c
            metrics["clip_frac_lower"] = token_share(((pg > cap) & (adv < 0)).float(), mask, inputs)
            pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
        if self.tis_cap is not None:
            rollout = inputs.fields["rollout_log_probs"].to(log_probs.dtype)
            weight = torch.clamp(torch.exp(torch.clamp(old - rollout, max=LOG_RATIO_CLAMP)), max=self.tis_cap)
            metrics["tis_weight_mean"] = token_share(weight, mask, inputs)
            pg = pg * weight.detach()
        return aggregate(pg, mask, inputs, self.agg_mode, self.agg_norm_tokens), metrics


class ClippedWeightLoss(PPOLoss):
    """CISPO's rule (MiniMax-M1, 2025): clip the importance weight, not the update. Per token
    ``-A * sg[clip(ratio, 1 - low, 1 + high)] * logp``: every token keeps a gradient, scaled by its
    clipped weight (PPO's clip zeroes the gradient of a clipped token)."""

    token_separable = True

    def _policy_gradient(self, inputs, log_probs, old, adv, mask):
        CALLS.append(type(self).__name__)
        ratio = torch.exp(torch.clamp(log_probs - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
        weight = torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        clipped = weight != ratio
        return aggregate(-adv * weight * log_probs, mask, inputs, self.agg_mode), \
            clip_metrics(clipped, adv, ratio, mask, inputs)


ppo_again = PolicyLoss("ppo_again", PPOAgain, "PPO written again in a user's file", 0.2, 0.28)
clipped_weight = PolicyLoss("clipped_weight", ClippedWeightLoss, "CISPO: a clipped, detached importance weight "
                            "times log-prob", 0.5, 0.2, per_token_corrections=False)


# The mistakes.
class Unregistered(PPOLoss):
    """A loss class named directly, without its PolicyLoss entry."""


not_a_loss_class = PolicyLoss("not_a_loss_class", dict, "a class that is no PPOLoss", 0.2, 0.28)
low_above_one = PolicyLoss("low_above_one", PPOAgain, "a lower clip range that forbids every ratio", 1.5, 0.28)
bad_agg_mode = PolicyLoss("bad_agg_mode", PPOAgain, "an aggregation that does not exist", 0.2, 0.28,
                          agg_mode="token-median")
unknown_option = PolicyLoss("unknown_option", PPOAgain, "an option the class does not take", 0.2, 0.28,
                            options={"temperature": 2.0})


class RaisesLoss(PPOLoss):
    def _policy_gradient(self, inputs, log_probs, old, adv, mask):
        return log_probs.sum() / 0, {}["missing"]


class NoTupleLoss(PPOLoss):
    def __call__(self, inputs):
        return inputs.log_probs.sum()


class NoGradientLoss(PPOLoss):
    def _policy_gradient(self, inputs, log_probs, old, adv, mask):
        return (adv * mask).sum(), {}


raises = PolicyLoss("raises", RaisesLoss, "a loss with a bug", 0.2, 0.28)
no_tuple = PolicyLoss("no_tuple", NoTupleLoss, "a loss returning the loss alone", 0.2, 0.28)
no_gradient = PolicyLoss("no_gradient", NoGradientLoss, "a loss that does not depend on the log-probs", 0.2, 0.28)


class FailsOnBiggerBatchesLoss(PPOLoss):
    def _policy_gradient(self, inputs, log_probs, old, adv, mask):
        if inputs.global_num_seqs > 2:
            raise RuntimeError(f"{inputs.global_num_seqs} sequences")
        return super()._policy_gradient(inputs, log_probs, old, adv, mask)


fails_on_bigger_batches = PolicyLoss("fails_on_bigger_batches", FailsOnBiggerBatchesLoss, "a loss that fails late",
                                     0.2, 0.28)
