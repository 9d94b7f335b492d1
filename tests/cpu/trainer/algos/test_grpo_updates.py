"""Update-many: 2 epochs x 2 mini-batches through the engine equal a plain-torch PPO loop."""
import pytest
import torch

from tests.helpers.engine_cases import PRESET, engine_config, masks_for
from tests.helpers.engine_reference import full_state_dict, prompt_lengths, reference_logprobs, reference_model, sequences
from polyfsdp.engines.config import ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import PPOLoss
from polyfsdp.trainer.data.batch import build_batch, per_sequence
from polyfsdp.trainer.algos.updates import mini_batch_plan, run_updates, summarise_updates

GROUPS, GROUP_SIZE, MINI_BATCHES, EPOCHS = 4, 2, 2, 2
LR, EPS, CLIP = 0.05, 1e-6, 0.2


def _optim():
    # A large lr so the second update sees ratios outside the clip range; a large Adam eps
    # so fp32 noise in near-zero gradients does not become O(lr) moves over four steps.
    return OptimConfig(lr=LR, eps=EPS, weight_decay=0.0, grad_clip=1.0)


def _data():
    seqs = sequences([7, 5, 9, 6, 8, 4, 6, 10], seed=3)
    prompts = prompt_lengths(seqs)
    pairs = [(s[:p].tolist(), s[p:].tolist()) for s, p in zip(seqs, prompts)]
    adv = [1.0, -1.0, 0.5, -0.5, -1.2, 1.2, 0.8, -0.8]
    return seqs, pairs, adv


def _reference_loop(initial, seqs, adv, plan):
    """Plain HF model + torch AdamW: token-mean clipped PPO loss per mini-batch, old
    log-probs from the sampling (initial) weights."""
    model = reference_model(PRESET, initial).train()
    masks = masks_for(seqs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    with torch.no_grad():
        old, _ = reference_logprobs(model, seqs, [1.0] * len(seqs))
    for indices in plan:
        lps, _ = reference_logprobs(model, [seqs[i] for i in indices], [1.0] * len(indices))
        total, count = 0.0, sum(masks[i].sum() for i in indices)
        for lp, i in zip(lps, indices):
            ratio = torch.exp(lp - old[i])
            pg = torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - CLIP, 1 + CLIP))
            total = total + (pg * masks[i].double()).sum()
        (total / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items() if k in initial}


def test_mini_batch_plan_keeps_groups_together_and_covers_each_once_per_epoch():
    plan = mini_batch_plan(GROUPS, GROUP_SIZE, MINI_BATCHES, EPOCHS, seed=11)
    assert len(plan) == EPOCHS * MINI_BATCHES
    for epoch in range(EPOCHS):
        seen = sorted(i for mb in plan[epoch * MINI_BATCHES:(epoch + 1) * MINI_BATCHES] for i in mb)
        assert seen == list(range(GROUPS * GROUP_SIZE))
    for mb in plan:
        assert all(mb[k] // GROUP_SIZE == mb[k + 1] // GROUP_SIZE for k in range(0, len(mb), GROUP_SIZE))
    assert plan == mini_batch_plan(GROUPS, GROUP_SIZE, MINI_BATCHES, EPOCHS, seed=11)  # seeded: resume-exact
    assert mini_batch_plan(GROUPS, GROUP_SIZE, 1, 1, seed=11) == [list(range(8))]  # one mini-batch: as sampled


@pytest.mark.parametrize("pad_mode", ["no_padding", "left_right"])
def test_two_epochs_of_two_mini_batches_match_a_plain_torch_reference_loop(pad_mode):
    seqs, pairs, adv = _data()
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5), engine_config(pad_mode=pad_mode,
                                                                          max_tokens_per_micro_batch=20),
                        _optim()).initialize()
    initial = full_state_dict(engine.module)
    batch = build_batch(pairs, pad_mode, 0)
    old = per_sequence(engine.infer_batch(batch, calculate_entropy=False)["log_probs"], batch, pad_mode)
    fields = {"old_log_probs": old, "advantages": [torch.full((len(s),), a) for s, a in zip(seqs, adv)]}
    plan = mini_batch_plan(GROUPS, GROUP_SIZE, MINI_BATCHES, EPOCHS, seed=11)
    updates = run_updates(engine, pairs, fields, plan, PPOLoss(clip_ratio_low=CLIP, clip_ratio_high=CLIP), 0, 1.0)

    expected = _reference_loop(initial, seqs, adv, plan)
    actual = full_state_dict(engine.module)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=2e-4, rtol=1e-3, msg=name)
    # Four steps of lr 0.05 move the weights far beyond that tolerance.
    assert max((actual[k] - initial[k]).abs().max().item() for k in expected) > 0.1
    # The first update is on-policy (ratio 1, nothing clipped); later ones see the moved policy.
    assert updates[0]["clip_frac"] == 0.0 and updates[0]["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert max(u["clip_frac"] for u in updates[1:]) > 0.0
    assert all(u["clip_frac"] == pytest.approx(u["clip_frac_low"] + u["clip_frac_high"]) for u in updates)
    summary = summarise_updates(updates)
    assert summary["updates"] == 4 and summary["ratio_max"] == max(u["ratio_max"] for u in updates)
    assert summary["clip_frac"] == pytest.approx(sum(u["clip_frac"] for u in updates) / 4)
