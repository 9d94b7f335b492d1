"""infer_batch in every mode combination equals a per-sequence Hugging Face reference.

Matrix: {remove_padding} x {fused} x {no_padding, left_right} x {T=1, per-sample T} x
{qwen2, qwen3, llama, qwen2 with tied embeddings}. Tolerance: fp32, max abs diff <= 1e-5
for log_probs and entropy (the reference runs each sequence alone, unsharded, with eager
attention; our paths differ only by summation order).
"""
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.engine_reference import (built_once_per_key, full_state_dict, left_right_batch, no_padding_batch, prompt_lengths,
                              reference_logprobs, reference_model, sequences)
from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.batch.flat import batch_to_flat

TOL = 1e-5
FAMILIES = ["qwen2-tiny", "qwen3-tiny", "llama-tiny", "qwen2-tiny-tied"]
# Equal lengths (6, 6, 6), a length-1 sequence and the maximum-length one (12).
LENGTHS = [6, 1, 12, 6, 6, 3]
MODES = [(rm, fu) for rm in (True, False) for fu in (True, False)]
TEMPS = {"t1": None, "per_sample": torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 0.9])}


class Family:
    """One engine per family (modes are flipped per call) and its reference results."""

    def __init__(self, preset):
        self.engine = FSDPEngine(ModelConfig(preset=preset, seed=3), EngineConfig()).initialize()
        self.reference = reference_model(preset, full_state_dict(self.engine.module))
        self.seqs = sequences(LENGTHS, seed=11)
        self.expected = {}
        with torch.no_grad():
            for name, temps in TEMPS.items():
                t = [1.0] * len(LENGTHS) if temps is None else temps.tolist()
                self.expected[name] = reference_logprobs(self.reference, self.seqs, t)


@pytest.fixture(scope="module")
def family():
    yield from built_once_per_key(Family)


def _flat_from_caller(out, batch, pad_mode):
    if pad_mode == "no_padding":
        assert out.is_nested and out.layout == torch.jagged
        assert torch.equal(out.offsets(), batch["input_ids"].offsets()), "offsets differ from the input's"
        return out.values()
    mask = batch["attention_mask"].bool()
    assert out.shape == batch["input_ids"].shape and not out.is_nested
    assert torch.all(out[~mask] == 0), "padding positions must be zero"
    return out[mask]


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("temp_name", list(TEMPS))
@pytest.mark.parametrize("pad_mode", ["no_padding", "left_right"])
@pytest.mark.parametrize("rmpad,fused", MODES, ids=[f"rmpad{int(a)}-fused{int(b)}" for a, b in MODES])
def test_infer_batch_matches_per_sequence_reference(family, preset, temp_name, pad_mode, rmpad, fused):
    fam = family(preset)
    engine = fam.engine
    engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                   pad_mode=pad_mode)
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    batch = build(fam.seqs)
    temps = TEMPS[temp_name]
    out = engine.infer_batch(batch, temperature=1.0 if temps is None else temps)
    assert out.batch_size == torch.Size([len(LENGTHS)])
    exp_lp, exp_ent = fam.expected[temp_name]
    got_lp = _flat_from_caller(out["log_probs"], batch, pad_mode)
    got_ent = _flat_from_caller(out["entropy"], batch, pad_mode)
    assert got_lp.dtype == torch.float32 and got_ent.dtype == torch.float32
    assert (got_lp.double() - torch.cat(exp_lp)).abs().max() <= TOL
    assert (got_ent.double() - torch.cat(exp_ent)).abs().max() <= TOL


def test_all_equal_lengths_batch_keeps_layout(family):
    # Nested tensors have mis-picked the ragged dim when every length is equal.
    fam = family("qwen2-tiny")
    seqs = sequences([5, 5, 5], seed=2)
    engine = fam.engine
    with torch.no_grad():
        exp_lp, exp_ent = reference_logprobs(fam.reference, seqs, [1.0] * 3)
    for pad_mode, build in (("no_padding", no_padding_batch), ("left_right", left_right_batch)):
        engine.engine_config = replace(engine.engine_config, pad_mode=pad_mode, use_remove_padding=True)
        batch = build(seqs)
        out = engine.infer_batch(batch)
        got = _flat_from_caller(out["log_probs"], batch, pad_mode)
        assert (got.double() - torch.cat(exp_lp)).abs().max() <= TOL


def test_zero_length_sequences_and_empty_batch(family):
    fam = family("qwen2-tiny")
    engine = fam.engine
    seqs = sequences([4, 0, 5, 0], seed=8)
    with torch.no_grad():
        exp_lp, _ = reference_logprobs(fam.reference, seqs, [1.0] * 4)
    empty = no_padding_batch([torch.zeros(0, dtype=torch.long)] * 2)
    for rmpad, fused in MODES:
        engine.engine_config = replace(engine.engine_config, pad_mode="no_padding", use_remove_padding=rmpad,
                                       use_fused_kernels=fused)
        batch = no_padding_batch(seqs)
        out = engine.infer_batch(batch)
        assert torch.equal(out["log_probs"].offsets(), batch["input_ids"].offsets())
        assert (out["log_probs"].values().double() - torch.cat(exp_lp)).abs().max() <= TOL
        assert out["entropy"].values().shape == out["log_probs"].values().shape
        nothing = engine.infer_batch(empty)
        assert nothing["log_probs"].values().numel() == 0 and nothing["entropy"].values().numel() == 0


def test_calculate_entropy_false_returns_only_log_probs(family):
    fam = family("qwen2-tiny")
    fam.engine.engine_config = replace(fam.engine.engine_config, pad_mode="no_padding")
    out = fam.engine.infer_batch(no_padding_batch(fam.seqs), calculate_entropy=False)
    assert set(out.keys()) == {"log_probs"}


def _grads(engine, batch, mask_key="response_mask"):
    flat = batch_to_flat(batch, engine.engine_config.pad_mode)
    log_probs, _ = engine.forward_flat(flat, return_entropy=False)
    (log_probs * flat.fields[mask_key]).sum().backward()
    grads = {}
    for name, p in engine.module.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = g.detach().clone()
    engine.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("preset", ["qwen2-tiny-tied", "llama-tiny"])
def test_gradients_of_masked_log_prob_sum_agree_across_all_modes_and_reference(family, preset):
    fam = family(preset)
    engine = fam.engine
    seqs = fam.seqs
    prompts = prompt_lengths(seqs)
    # Response mask aligned with log_probs: position t counts when x[t+1] is a response token.
    masks = []
    for s, p in zip(seqs, prompts):
        m = torch.zeros(len(s))
        m[max(p - 1, 0): len(s) - 1] = 1.0
        masks.append(m)
    # Reference: the unsharded model, each sequence alone.
    ref = fam.reference
    ref.zero_grad(set_to_none=True)
    lps, _ = reference_logprobs(ref, seqs, [1.0] * len(seqs))
    sum(lp.dot(m.double()) for lp, m in zip(lps, masks)).backward()
    expected = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)
    scale = max(g.abs().max().item() for g in expected.values())
    for pad_mode, build in (("no_padding", no_padding_batch), ("left_right", left_right_batch)):
        batch = build(seqs, per_token={"response_mask": masks})
        for rmpad, fused in MODES:
            engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad,
                                           use_fused_kernels=fused, pad_mode=pad_mode)
            with engine.train_mode():
                grads = _grads(engine, batch)
            for name, g in grads.items():
                diff = (g.double() - expected[name].double()).abs().max().item()
                # Gradients sum many fp32 terms: 1e-5 relative to the largest gradient entry.
                assert diff <= 1e-5 * scale, (pad_mode, rmpad, fused, name, diff, scale)


def test_micro_batch_split_gives_the_same_results(family):
    fam = family("qwen3-tiny")
    engine = fam.engine
    for rmpad in (True, False):
        engine.engine_config = replace(engine.engine_config, pad_mode="no_padding", use_remove_padding=rmpad,
                                       use_fused_kernels=False, max_tokens_per_micro_batch=None)
        batch = no_padding_batch(fam.seqs)
        whole = engine.infer_batch(batch, temperature=TEMPS["per_sample"])
        engine.engine_config = replace(engine.engine_config, max_tokens_per_micro_batch=13)
        split = engine.infer_batch(batch, temperature=TEMPS["per_sample"])
        engine.engine_config = replace(engine.engine_config, max_tokens_per_micro_batch=None)
        assert torch.equal(split["log_probs"].offsets(), batch["input_ids"].offsets())
        for key in ("log_probs", "entropy"):
            assert (split[key].values() - whole[key].values()).abs().max() <= 1e-6


def test_fused_per_sample_temperature_with_empty_sequences_under_a_small_budget(family):
    # Budget 3 < the longest sequence and two empty sequences: the split makes token-less
    # groups (placeholders); per-sample temperatures must still reach every group intact.
    fam = family("qwen2-tiny")
    engine = fam.engine
    seqs = [fam.seqs[0], fam.seqs[0][:0], fam.seqs[2], fam.seqs[0][:0]]
    temps = torch.tensor([0.7, 1.3, 2.0, 0.5])
    with torch.no_grad():
        exp_lp, exp_ent = reference_logprobs(fam.reference, seqs, temps.tolist())
    for rmpad in (True, False):
        engine.engine_config = replace(engine.engine_config, pad_mode="no_padding", use_remove_padding=rmpad,
                                       use_fused_kernels=True, max_tokens_per_micro_batch=3)
        try:
            out = engine.infer_batch(no_padding_batch(seqs), temperature=temps)
        finally:
            engine.engine_config = replace(engine.engine_config, use_fused_kernels=False,
                                           max_tokens_per_micro_batch=None)
        assert (out["log_probs"].values().double() - torch.cat(exp_lp).double()).abs().max() <= TOL
        assert (out["entropy"].values().double() - torch.cat(exp_ent).double()).abs().max() <= TOL


def test_no_padding_outputs_are_rewrapped_without_reading_offsets_back():
    # The edge reads the host batch's lengths once; after the batch moved to a device, no
    # output conversion may read its offsets back. Meta tensors have no data: any host read
    # of them (a device sync on an accelerator) raises.
    from tensordict import TensorDict

    from polyfsdp.engines import jagged
    from polyfsdp.engines.batch.flat import flat_to_caller

    ids = jagged.make_jagged(torch.zeros(8, dtype=torch.long), torch.tensor([0, 3, 4, 8]))
    batch = TensorDict({"input_ids": ids}, batch_size=[3])
    flat = batch_to_flat(batch, "no_padding").to(torch.device("meta"))
    assert flat.offsets.is_meta and flat.seq_lens == [3, 1, 4]
    out = flat_to_caller(torch.zeros(8, device="meta"), flat, batch, "no_padding")
    assert out.is_nested and out.shape[0] == 3
    assert (out._min_seqlen, out._max_seqlen) == (1, 4)
