"""A critic (ModelConfig(value_head=True)) in every mode combination against an independent
per-sequence reference: the plain HF decoder body's hidden states times the head's weight
plus bias, each sequence alone, last position 0. fp32, max abs diff <= 1e-5. Also one
ValueLoss gradient per mode against autograd on that reference."""
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.engine_reference import (full_state_dict, left_right_batch, no_padding_batch, per_sequence,
                              sequences)
from tests.helpers.engine_cases import masks_for
from tests.helpers.value_reference import CriticReference
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses.value import ValueLoss

TOL = 1e-5
FAMILIES = ["qwen2-tiny", "qwen2-tiny-tied", "llama-tiny"]
LENGTHS = [6, 1, 12, 6, 0, 3]
MODES = [(rm, fu, pm) for rm in (True, False) for fu in (True, False) for pm in ("no_padding", "left_right")]
IDS = [f"rmpad{int(a)}-fused{int(b)}-{c}" for a, b, c in MODES]


class Critic(CriticReference):
    """One critic engine per family and its reference (tests/helpers/value_reference.py)."""

    def __init__(self, preset):
        self.engine = FSDPEngine(ModelConfig(preset=preset, seed=5, value_head=True, value_head_init_std=0.5),
                                 EngineConfig(), OptimConfig(lr=1e-3)).initialize()
        super().__init__(preset, full_state_dict(self.engine.module))
        self.seqs = sequences(LENGTHS, seed=13)


def _absmax(t):
    return float(t.abs().max()) if t.numel() else 0.0


_critics = {}


@pytest.fixture(scope="module")
def critic():
    def get(preset):
        if preset not in _critics:
            _critics[preset] = Critic(preset)
        return _critics[preset]

    yield get
    _critics.clear()


def _batch(seqs, pad_mode, per_token=None):
    if pad_mode == "left_right":
        # left_right needs at least one token per sequence.
        seqs = [s for s in seqs if len(s)]
        per_token = {k: [v for v, s in zip(vs, seqs) if len(s)] for k, vs in (per_token or {}).items()}
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    return seqs, build(seqs, per_token=per_token)


def _set_modes(engine, rmpad, fused, pad_mode, budget=None):
    engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                   pad_mode=pad_mode, max_tokens_per_micro_batch=budget)


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("rmpad,fused,pad_mode", MODES, ids=IDS)
def test_infer_values_matches_the_per_sequence_reference(critic, preset, rmpad, fused, pad_mode):
    c = critic(preset)
    _set_modes(c.engine, rmpad, fused, pad_mode)
    seqs, batch = _batch(c.seqs, pad_mode)
    out = c.engine.infer_values(batch)
    assert set(out.keys()) == {"values"} and out.batch_size == torch.Size([len(seqs)])
    values = out["values"]
    if pad_mode == "no_padding":
        assert values.is_nested and torch.equal(values.offsets(), batch["input_ids"].offsets())
    else:
        assert values.shape == batch["input_ids"].shape
        assert torch.all(values[~batch["attention_mask"].bool()] == 0), "padding positions must be zero"
    got = per_sequence(values, batch, pad_mode)
    with torch.no_grad():
        expected = c.reference_values(seqs)
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32 and g.shape == e.shape
        assert _absmax(g.double() - e) <= TOL
        if len(g):
            assert g[-1] == 0.0, "the last position has no next token: value 0"
    # Negative control: the values are not trivially small (the check above could not pass by zeros).
    assert max(_absmax(e) for e in expected) > 0.1


def test_micro_batch_split_gives_the_same_values(critic):
    c = critic("qwen2-tiny")
    _set_modes(c.engine, True, False, "no_padding")
    _, batch = _batch(c.seqs, "no_padding")
    whole = c.engine.infer_values(batch)["values"].values()
    _set_modes(c.engine, True, False, "no_padding", budget=7)
    split = c.engine.infer_values(batch)["values"].values()
    _set_modes(c.engine, True, False, "no_padding")
    assert (split - whole).abs().max() <= 1e-6


@pytest.mark.parametrize("rmpad,fused,pad_mode", MODES, ids=IDS)
def test_value_loss_gradients_match_the_reference_in_every_mode(critic, rmpad, fused, pad_mode):
    c = critic("qwen2-tiny-tied")
    g = torch.Generator().manual_seed(4)
    seqs = [s for s in c.seqs if len(s)]
    masks = masks_for(seqs)
    old = [torch.randn(len(s), generator=g) * 0.5 for s in seqs]
    returns = [torch.randn(len(s), generator=g) for s in seqs]
    expected_loss, expected = c.value_loss_grads(seqs, masks, old, returns, clip=0.3)
    scale = max(v.abs().max().item() for v in expected.values())
    _set_modes(c.engine, rmpad, fused, pad_mode)
    _, batch = _batch(seqs, pad_mode, {"response_mask": masks, "old_values": old, "returns": returns})
    # Budget 7 splits the batch: shares of the global counts must add up to the whole.
    _set_modes(c.engine, rmpad, fused, pad_mode, budget=7)
    sums = c.engine.forward_backward(batch, ValueLoss(cliprange_value=0.3))
    _set_modes(c.engine, rmpad, fused, pad_mode)
    assert float(sums["loss"]) == pytest.approx(expected_loss, abs=1e-6)
    assert 0.0 < float(sums["vf_clip_frac"]) < 1.0, "the case must clip some tokens and not others"
    for name, p in c.engine.module.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert (got.double() - expected[name].double()).abs().max().item() <= 1e-5 * scale, name
    c.engine.optimizer.zero_grad(set_to_none=True)
    c.engine._pending = {}


def test_a_critic_step_moves_values_towards_the_returns(critic):
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=5, value_head=True), EngineConfig(),
                        OptimConfig(lr=1e-2)).initialize()
    seqs = sequences([8, 6, 9], seed=3)
    masks = masks_for(seqs)
    returns = [torch.full((len(s),), 1.0) for s in seqs]
    batch = no_padding_batch(seqs, per_token={"response_mask": masks, "returns": returns,
                                              "old_values": [torch.zeros(len(s)) for s in seqs]})
    losses = [engine.train_batch(batch, ValueLoss(cliprange_value=None))["vf_loss"] for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0]


def test_policy_and_critic_calls_do_not_mix(critic):
    c = critic("qwen2-tiny")
    _set_modes(c.engine, True, False, "no_padding")
    _, batch = _batch(c.seqs, "no_padding")
    with pytest.raises(ValueError, match="infer_values"):
        c.engine.infer_batch(batch)
    policy = FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig()).initialize()
    with pytest.raises(ValueError, match="value_head=True"):
        policy.infer_values(batch)
    with pytest.raises(ValueError, match="value_head_init_std"):
        ModelConfig(preset="qwen2-tiny", value_head=True, value_head_init_std=float("nan"))


def test_exported_value_head_loads_into_a_new_critic(tmp_path):
    trained = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=5, value_head=True, value_head_init_std=0.5),
                         EngineConfig(), OptimConfig(lr=1e-3)).initialize()
    path = tmp_path / "value_head.safetensors"
    trained.export_value_head(path)
    # A different seed would draw a different head: only the file can make them agree.
    loaded = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=5, value_head=True, value_head_init_std=0.01,
                                    value_head_path=str(path)), EngineConfig()).initialize()
    fresh = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=5, value_head=True, value_head_init_std=0.01),
                       EngineConfig()).initialize()
    batch = no_padding_batch(sequences([5, 3, 7], seed=2))
    want = trained.infer_values(batch)["values"].values()
    assert torch.equal(loaded.infer_values(batch)["values"].values(), want)
    assert (fresh.infer_values(batch)["values"].values() - want).abs().max() > 1e-3  # negative control


def test_value_head_path_errors_are_one_line(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="value_head=False"):
        ModelConfig(preset="qwen2-tiny", value_head_path=str(tmp_path / "x.safetensors"))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"weight": torch.zeros(1, 3), "bias": torch.zeros(1)}, str(wrong))
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    for path, message in ((tmp_path / "missing.safetensors", "no such file"), (wrong, "needs"),
                          (broken, "not a readable safetensors file")):
        engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", value_head=True, value_head_path=str(path)),
                            EngineConfig())
        with pytest.raises((ValueError, OSError), match=message) as info:
            engine.initialize()
        assert "\n" not in str(info.value)
