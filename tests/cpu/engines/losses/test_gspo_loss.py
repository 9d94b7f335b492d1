"""GSPO (engines/losses.GSPOLoss, algo.actor.policy_loss=gspo|gspo_token) against a hand-written
per-sequence reference in float64: loss values AND gradients, micro-batch shares, GSPO-token,
the config's choices, and a short polyfsdp-train job."""
import math

import pytest
import torch

from tests.helpers.loss_cases import loss_inputs_from_sequences
from polyfsdp.engines.losses import GSPO_CLIP_RATIO_HIGH, GSPO_CLIP_RATIO_LOW, GSPOLoss, is_token_separable
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError


def _batch(seed: int = 0, spread: float = 0.05):
    """Ragged sequences: a prompt part (mask 0), a response (mask 1); one with no response at all."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [4, 7, 1, 5, 6], [1, 2, 1, 0, 3]
    logp = [-torch.rand(n, generator=g, dtype=torch.float64) * 2 for n in lengths]
    old = [lp + spread * torch.randn(len(lp), generator=g, dtype=torch.float64) for lp in logp]
    masks = [torch.tensor([0.0] * p + [1.0] * (n - p), dtype=torch.float64) for n, p in zip(lengths, prompts)]
    masks[2] = torch.zeros(1, dtype=torch.float64)  # the length-1 sequence has no response token
    seq_adv = torch.tensor([1.0, -0.7, 0.3, 0.5, -1.2], dtype=torch.float64)
    adv = [torch.full((n,), float(a), dtype=torch.float64) for n, a in zip(lengths, seq_adv)]
    return logp, old, masks, adv


def _reference_gspo(logp, old, masks, adv, low, high):
    """GSPO's objective written out per sequence: s_i = exp(mean over i's response tokens of
    (logp - old)), A_i = the mean of its token advantages, loss = mean_i max(-A_i s_i,
    -A_i clip(s_i, 1 - low, 1 + high)); a sequence without response tokens adds 0."""
    total = 0.0
    for lp, o, m, a in zip(logp, old, masks, adv):
        n = m.sum()
        if n == 0:
            continue
        s = torch.exp(torch.clamp(((lp - o) * m).sum() / n, max=10.0))
        a_i = (a * m).sum() / n
        total = total + torch.maximum(-a_i * s, -a_i * torch.clamp(s, 1 - low, 1 + high))
    return total / len(logp)


def _reference_gspo_token(logp, old, masks, adv, low, high):
    """GSPO-token: per token s_i,t = sg[s_i] * pi_t / sg[pi_t], its own advantage A_i,t, the
    clipped term per token, each sequence's mean over its response tokens, then the mean
    over sequences."""
    total = 0.0
    for lp, o, m, a in zip(logp, old, masks, adv):
        n = m.sum()
        if n == 0:
            continue
        s_i = torch.exp(((lp - o) * m).sum().detach() / n)
        terms = []
        for t in range(len(lp)):
            if m[t] == 0:
                continue
            s_t = s_i * torch.exp(lp[t] - lp[t].detach())
            terms.append(torch.maximum(-a[t] * s_t, -a[t] * torch.clamp(s_t, 1 - low, 1 + high)))
        total = total + sum(terms) / n
    return total / len(logp)


def _ours(loss_fn, logp, old, masks, adv, split=None):
    """Our loss and its gradient w.r.t. every log-prob; ``split`` cuts the sequences into
    micro-batches (global counts of the whole batch), whose shares are summed."""
    leaves = [lp.clone().float().requires_grad_(True) for lp in logp]
    parts = split or [list(range(len(logp)))]
    num_tokens = float(sum(m.sum() for m in masks))
    total = 0.0
    for part in parts:
        inputs = loss_inputs_from_sequences(
            [leaves[i] for i in part],
            {"response_mask": [masks[i].float() for i in part], "old_log_probs": [old[i].float() for i in part],
             "advantages": [adv[i].float() for i in part]},
            global_num_tokens=num_tokens, global_num_seqs=len(logp))
        loss, metrics = loss_fn(inputs)
        loss.backward()
        total += float(loss.detach())
    return total, [lp.grad.double() for lp in leaves], metrics


def _reference_grads(reference, logp, old, masks, adv, low, high):
    leaves = [lp.clone().requires_grad_(True) for lp in logp]
    value = reference(leaves, old, masks, adv, low, high)
    value.backward()
    return float(value.detach()), [torch.zeros_like(lp) if lp.grad is None else lp.grad for lp in leaves]


@pytest.mark.parametrize("low, high, spread", [
    (GSPO_CLIP_RATIO_LOW, GSPO_CLIP_RATIO_HIGH, 0.05),  # verl's defaults: most sequences clipped
    (0.02, 0.03, 0.02),                                  # some in range, some clipped
    (0.9, 5.0, 0.3),                                     # none clipped
])
def test_gspo_matches_the_hand_written_reference_in_value_and_gradient(low, high, spread):
    logp, old, masks, adv = _batch(spread=spread)
    ours, grads, metrics = _ours(GSPOLoss(clip_ratio_low=low, clip_ratio_high=high), logp, old, masks, adv)
    ref_value, ref_grads = _reference_grads(_reference_gspo, logp, old, masks, adv, low, high)
    assert ours == pytest.approx(ref_value, abs=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    assert 0.0 <= float(metrics["clip_frac"]) <= 1.0 and float(metrics["ratio_max"]) > 0


def test_gspo_gradients_couple_the_tokens_of_a_sequence():
    """Not a sum of per-token terms: one token's gradient moves when ANOTHER token of its
    sequence changes (PPO's would not), so the fused head must not take it."""
    logp, old, masks, adv = _batch(spread=0.3)
    loss = GSPOLoss(clip_ratio_low=0.9, clip_ratio_high=5.0)
    _, before, _ = _ours(loss, logp, old, masks, adv)
    logp[1] = logp[1].clone()
    logp[1][-1] += 0.5
    _, after, _ = _ours(loss, logp, old, masks, adv)
    assert not torch.allclose(before[1][2], after[1][2])  # token 2 of sequence 1: its gradient changed
    assert torch.equal(before[0], after[0])               # another sequence: untouched
    assert not is_token_separable(loss)


def test_gspo_shares_of_micro_batches_sum_to_the_whole():
    logp, old, masks, adv = _batch(seed=3, spread=0.02)
    loss = GSPOLoss(clip_ratio_low=0.02, clip_ratio_high=0.03)
    whole, whole_grads, _ = _ours(loss, logp, old, masks, adv)
    parts, part_grads, _ = _ours(loss, logp, old, masks, adv, split=[[0, 3], [1, 2, 4]])
    assert parts == pytest.approx(whole, abs=1e-7)
    for a, b in zip(whole_grads, part_grads):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_gspo_token_matches_its_reference_and_equals_gspo_with_one_advantage_per_sequence():
    logp, old, masks, adv = _batch(seed=5, spread=0.02)
    low, high = 0.02, 0.03
    token_loss = GSPOLoss(clip_ratio_low=low, clip_ratio_high=high, sequence_level=False)
    # Per-token advantages: against the token form's own reference.
    g = torch.Generator().manual_seed(9)
    per_token = [a + 0.3 * torch.randn(len(a), generator=g, dtype=torch.float64) for a in adv]
    ours, grads, _ = _ours(token_loss, logp, old, masks, per_token)
    ref_value, ref_grads = _reference_grads(_reference_gspo_token, logp, old, masks, per_token, low, high)
    assert ours == pytest.approx(ref_value, abs=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # One advantage per sequence (the group estimators'): the two forms are one loss.
    seq_value, seq_grads, _ = _ours(GSPOLoss(clip_ratio_low=low, clip_ratio_high=high), logp, old, masks, adv)
    tok_value, tok_grads, _ = _ours(token_loss, logp, old, masks, adv)
    assert tok_value == pytest.approx(seq_value, abs=1e-6)
    for a, b in zip(seq_grads, tok_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_gspo_on_policy_has_ratio_one_and_the_mean_log_prob_gradient():
    """One update per rollout (on_policy): s_i = 1, so the gradient of sequence i's token t is
    -A_i / (n_i * N) (N sequences), whatever the clip range."""
    logp, _, masks, adv = _batch()
    loss = GSPOLoss(on_policy=True)
    leaves = [lp.clone().float().requires_grad_(True) for lp in logp]
    inputs = loss_inputs_from_sequences(leaves, {"response_mask": [m.float() for m in masks],
                                                 "advantages": [a.float() for a in adv]})
    value, metrics = loss(inputs)
    value.backward()
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0) and float(metrics["clip_frac"]) == 0.0
    for leaf, m, a in zip(leaves, masks, adv):
        n = float(m.sum())
        expected = -float(a[0]) / (max(n, 1.0) * len(logp)) * m
        torch.testing.assert_close(leaf.grad.double(), expected, atol=1e-7, rtol=1e-6)


def test_the_config_builds_gspo_with_its_own_defaults_and_refuses_what_it_lacks():
    loss = load_config(["algo.actor.policy_loss=gspo"]).algo.actor_loss(32)
    assert isinstance(loss, GSPOLoss) and loss.sequence_level
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    token = load_config(["algo.actor.policy_loss=gspo_token", "algo.actor.clip_ratio_high=0.001"]).algo.actor_loss(32)
    assert not token.sequence_level and token.clip_ratio_high == 0.001
    for overrides, start in [
        (["algo.actor.policy_loss=gspo", "algo.actor.dual_clip_c=3"], "algo.actor.dual_clip_c: applies to"),
        (["algo.actor.policy_loss=gspo", "algo.rollout_correction.tis_cap=2"], "algo.rollout_correction.tis_cap:"),
        (["algo.actor.policy_loss=gspo", "algo.actor.agg_mode=seq-mean-token-sum"],
         "algo.actor.agg_mode: policy_loss=gspo aggregates with seq-mean-token-mean"),
        (["algo.actor.policy_loss=gspo", "algo.adv_estimator=dr_grpo"], "algo.actor.policy_loss: adv_estimator=dr_grpo"),
        (["algo.actor.policy_loss=gpso"], "algo.actor.policy_loss: got 'gpso'; allowed values: ppo, gspo, gspo_token, "
                                          "or path/to/file.py:NAME / package.module:NAME of your own (did you mean "
                                          "gspo?)"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(overrides)
        assert str(info.value).startswith(start) and "\n" not in str(info.value), str(info.value)


def test_a_short_gspo_job_trains(tmp_path):
    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    out = tmp_path / "gspo"
    code = main(["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
                 "algo.actor.group_size=4", "algo.actor.epochs=2", "algo.actor.policy_loss=gspo",
                 "algo.actor.clip_ratio_low=0.02", "algo.actor.clip_ratio_high=0.03", "data.eval_size=8",
                 "trainer.progress=off", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0",
                 f"trainer.output_dir={out}"])
    assert code == 0
    records = read_metrics(str(out / "metrics.jsonl"))
    steps = [r for r in records if r["phase"] == "rl"]
    updates = [r for r in records if r["phase"] == "rl_update"]
    assert [r["step"] for r in steps] == [1, 2] and [(u["step"], u["update"]) for u in updates] == \
        [(1, 1), (1, 2), (2, 1), (2, 2)]
    for u in updates:
        assert all(math.isfinite(u[k]) for k in ("pg_loss", "ratio_mean", "clip_frac", "grad_norm"))
    # The second update of a rollout is off policy: its sequence ratios have moved from 1.
    assert all(u["ratio_max"] != 1.0 for u in updates if u["update"] == 2)
