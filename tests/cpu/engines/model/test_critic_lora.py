"""A critic with LoRA adapters (ModelConfig(value_head=True, lora=...)): the base is frozen,
the value head trains beside the adapters. Values and clipped-value-loss gradients against
the independent reference (tests/helpers/value_reference.py) on the adapters merged by hand
(tests/helpers/lora_reference.py); adapter gradients by the chain rule through the merge
(dL/dA = s B^T dL/dW, dL/dB = s dL/dW A^T, s = alpha / rank)."""
import pytest
import torch

from tests.helpers.engine_cases import masks_for
from tests.helpers.engine_reference import full_state_dict, left_right_batch, no_padding_batch, per_sequence, sequences
from tests.helpers.lora_reference import merged_by_hand, randomize_adapters
from tests.helpers.value_reference import CriticReference
from polyfsdp.engines.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig
from polyfsdp.engines.losses.value import ValueLoss

peft = pytest.importorskip("peft", reason="LoRA tests need peft (pip install -e '.[lora]')")

from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

RANK, ALPHA = 4, 8.0
PRESET = "qwen2-tiny"
LENGTHS = [6, 2, 12, 5]
MODES = [(True, "no_padding"), (False, "left_right")]


def lora_critic():
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5, value_head=True, value_head_init_std=0.5,
                                    lora=LoraConfig(rank=RANK, alpha=ALPHA)),
                        EngineConfig(), OptimConfig(lr=1e-2, grad_clip=None)).initialize()
    randomize_adapters(engine.module, seed=1)  # peft's zero lora_B would hide the adapters
    return engine


@pytest.fixture(scope="module")
def critic():
    engine = lora_critic()
    state = full_state_dict(engine.module)
    return engine, CriticReference(PRESET, merged_by_hand(state, RANK, ALPHA)), state


def _batch(seqs, pad_mode, per_token=None):
    return (no_padding_batch if pad_mode == "no_padding" else left_right_batch)(seqs, per_token=per_token)


def _modes(engine, rmpad, pad_mode):
    from dataclasses import replace

    engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, pad_mode=pad_mode)


def test_only_the_adapters_and_the_value_head_train():
    engine = lora_critic()
    trained = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
    assert {"lm_head.weight", "lm_head.bias"} <= set(trained)
    assert all(".lora_" in n or n.startswith("lm_head.") for n in trained), trained
    assert any(".lora_A." in n for n in trained)


@pytest.mark.parametrize("rmpad,pad_mode", MODES)
def test_values_match_the_reference_with_the_adapters_merged_by_hand(critic, rmpad, pad_mode):
    engine, ref, state = critic
    _modes(engine, rmpad, pad_mode)
    seqs = sequences(LENGTHS, seed=13)
    batch = _batch(seqs, pad_mode)
    got = per_sequence(engine.infer_values(batch)["values"], batch, pad_mode)
    with torch.no_grad():
        expected = ref.reference_values(seqs)
        # Negative control: the base weights alone give other values (the adapters matter).
        base = CriticReference(PRESET, {k.replace(".base_layer.", "."): v for k, v in state.items()
                                        if ".lora_" not in k}).reference_values(seqs)
    assert max((g.double() - e).abs().max().item() for g, e in zip(got, expected)) <= 1e-5
    assert max((b - e).abs().max().item() for b, e in zip(base, expected)) > 1e-3


@pytest.mark.parametrize("rmpad,pad_mode", MODES)
def test_value_loss_gradients_of_head_and_adapters_match_the_reference(critic, rmpad, pad_mode):
    engine, ref, state = critic
    _modes(engine, rmpad, pad_mode)
    seqs = sequences(LENGTHS, seed=13)
    masks = masks_for(seqs)
    g = torch.Generator().manual_seed(4)
    old = [torch.randn(len(s), generator=g) * 0.5 for s in seqs]
    returns = [torch.randn(len(s), generator=g) for s in seqs]
    loss, grads = ref.value_loss_grads(seqs, masks, old, returns, clip=0.3)
    sums = engine.forward_backward(_batch(seqs, pad_mode, {"response_mask": masks, "old_values": old,
                                                          "returns": returns}), ValueLoss(cliprange_value=0.3))
    assert float(sums["loss"]) == pytest.approx(loss, rel=1e-6)  # fp32 against the reference
    scale = ALPHA / RANK
    expected = {"lm_head.weight": grads["lm_head.weight"], "lm_head.bias": grads["lm_head.bias"]}
    for name in state:
        if ".lora_A." in name:
            prefix = name.split(".lora_A.")[0]
            a, b = state[name].double(), state[name.replace("lora_A", "lora_B")].double()
            g_w = grads[f"{prefix}.weight"].double()
            expected[name] = scale * b.T @ g_w
            expected[name.replace("lora_A", "lora_B")] = scale * g_w @ a.T
    got = {n: p.grad for n, p in engine.module.named_parameters() if p.grad is not None}
    assert set(got) == set(expected)
    largest = max(v.abs().max().item() for v in expected.values())
    for name, value in expected.items():
        assert (got[name].double() - value.double()).abs().max().item() <= 1e-5 * largest, name
    engine.optimizer.zero_grad(set_to_none=True)
    engine._pending = {}


def test_training_moves_head_and_adapters_and_lowers_the_value_loss():
    engine = lora_critic()
    before = full_state_dict(engine.module)
    seqs = sequences([8, 6, 9], seed=3)
    masks = masks_for(seqs)
    batch = no_padding_batch(seqs, per_token={"response_mask": masks, "returns": [torch.ones(len(s)) for s in seqs],
                                              "old_values": [torch.zeros(len(s)) for s in seqs]})
    losses = [engine.train_batch(batch, ValueLoss(cliprange_value=None))["vf_loss"] for _ in range(10)]
    after = full_state_dict(engine.module)
    assert losses[-1] < 0.5 * losses[0]
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert {"lm_head.weight", "lm_head.bias"} <= moved and any(".lora_B." in k for k in moved)
    assert all(".lora_" in k or k.startswith("lm_head.") for k in moved), sorted(moved)
