"""Ulysses sequence parallelism (gloo, torchrun) against an unsharded per-sequence Hugging
Face reference and the sp=1 engine: every mode's log-probs and entropy (1e-5), gradients
after one forward_backward (1e-5), with sequences ending exactly on a shard boundary,
shorter than sp, of length 1, and a padded (odd) total. Also the attention function alone
(GQA key/value heads split over ranks, and repeated when fewer than ranks; polyfsdp's varlen
SDPA and the NPU fusion attention in TND layout on the plain-torch reference op) and SP ranks
holding different batches. sp=2 runs in the suite; sp=2 x dp=2 (4 processes) is marked extended."""
import os

import pytest
import torch

from tests.helpers.engine_cases import PRESET, engine_config, masks_for  # noqa: E402
from tests.helpers.engine_reference import (full_state_dict, left_right_batch, no_padding_batch, reference_logprobs,  # noqa: E402
                              reference_model, sequences)
from tests.helpers.sequence_parallel_cases import (CRITIC_CLIP, CRITIC_MODES, INFER_LENGTHS, MODES, TRAIN_LENGTHS,  # noqa: E402
                                     critic_fields, temperatures)
from tests.helpers.value_reference import CriticReference  # noqa: E402
from torchrun_launcher import run_and_load  # noqa: E402

from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

HERE = os.path.dirname(__file__)


def _launch(tmp_path_factory, nproc, sp_size):
    return run_and_load(os.path.join(HERE, "worker_sequence_parallel.py"),
                        tmp_path_factory.mktemp(f"sp{sp_size}_world{nproc}"), nproc, (str(sp_size),), "sp.pt")


@pytest.fixture(scope="module")
def sp2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, 2)


@pytest.fixture(scope="module")
def reference():
    """Plain HF model (per sequence, eager attention) holding the engines' initial weights."""
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5), engine_config()).initialize()
    return reference_model(PRESET, full_state_dict(engine.module))


def _flat(values, batch, pad_mode):
    if pad_mode == "no_padding":
        return values
    return values[batch["attention_mask"].bool()]


def _reference_grads(model, seqs, masks):
    model.zero_grad(set_to_none=True)
    lps, _ = reference_logprobs(model.train(), seqs, [1.0] * len(seqs))
    loss = -sum(lp.dot(m.double()) for lp, m in zip(lps, masks)) / sum(m.sum() for m in masks)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    return grads, float(loss.detach())


def check_modes(ranks, reference):
    """Every rank's results of every mode against the reference."""
    train_seqs = sequences(TRAIN_LENGTHS, seed=3)
    ref_grads, ref_loss = _reference_grads(reference, train_seqs, masks_for(train_seqs))
    for name, rmpad, fused, pad_mode, extra in MODES:
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        for which, lengths in enumerate((INFER_LENGTHS, TRAIN_LENGTHS)):
            seqs = sequences(lengths, seed=3)
            temps = temperatures(len(seqs))
            with torch.no_grad():
                ref_lp, ref_ent = reference_logprobs(reference, seqs, temps.tolist())
            batch = build(seqs)
            for rank, results in enumerate(ranks):
                got = results[f"infer_{name}_{which}"]
                for key, ref in (("log_probs", ref_lp), ("entropy", ref_ent)):
                    values = _flat(got[key], batch, pad_mode)
                    diff = (values.double() - torch.cat(ref)).abs().max().item()
                    assert diff <= 1e-5, f"{name} rank {rank} {key} lengths {lengths}: max |diff| {diff:.3g}"
        for rank, results in enumerate(ranks):
            assert abs(results[f"loss_{name}"] - ref_loss) <= 1e-5 * abs(ref_loss), name
            grads = results[f"grads_{name}"]
            for pname, ref in ref_grads.items():
                diff = (grads[pname].double() - ref.double()).abs().max().item()
                assert diff <= 1e-5, f"{name} rank {rank} grad {pname}: max |diff| {diff:.3g}"


def check_critic(ranks):
    """A critic's values and clipped-value-loss gradients under SP against the unsharded reference."""
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5, value_head=True, value_head_init_std=0.5),
                        engine_config()).initialize()
    ref = CriticReference(PRESET, full_state_dict(engine.module))
    infer_seqs, train_seqs = sequences(INFER_LENGTHS, seed=3), sequences(TRAIN_LENGTHS, seed=3)
    with torch.no_grad():
        expected = torch.cat(ref.reference_values(infer_seqs))
    old, returns = critic_fields(train_seqs)
    ref_loss, ref_grads = ref.value_loss_grads(train_seqs, masks_for(train_seqs), old, returns, CRITIC_CLIP)
    largest = max(g.abs().max().item() for g in ref_grads.values())
    for name, rmpad, pad_mode in CRITIC_MODES:
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        for rank, results in enumerate(ranks):
            got = _flat(results[f"values_{name}"], build(infer_seqs), pad_mode)
            assert (got.double() - expected).abs().max().item() <= 1e-5, f"{name} rank {rank} values"
            assert results[f"loss_{name}"] == pytest.approx(ref_loss, rel=1e-5), f"{name} rank {rank} loss"
            for pname, want in ref_grads.items():
                diff = (results[f"grads_{name}"][pname].double() - want.double()).abs().max().item()
                assert diff <= 1e-5 * largest, f"{name} rank {rank} grad {pname}: max |diff| {diff:.3g}"


def check_attention(ranks):
    for case in ("varlen_kv1", "varlen_kv2", "fusion_kv1", "fusion_kv2"):
        for rank, results in enumerate(ranks):
            got, ref = results[f"attention_{case}"]["out"]
            assert (got - ref).abs().max().item() <= 1e-5, (case, rank)
            for i, (g, r) in enumerate(results[f"attention_{case}"]["grads"]):
                assert g.shape == r.shape and (g - r).abs().max().item() <= 1e-5, (case, rank, "qkv"[i])


def test_sp2_every_mode_matches_the_reference(sp2, reference):
    check_modes(sp2, reference)


def test_sp2_matches_the_sp1_engine(sp2):
    seqs = sequences(INFER_LENGTHS, seed=3)
    for name, rmpad, fused, pad_mode, extra in MODES[:4]:
        engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5),
                            engine_config(use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode,
                                          **extra)).initialize()
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        out = engine.infer_batch(build(seqs), temperature=temperatures(len(seqs)))
        for key in ("log_probs", "entropy"):
            one = out[key].values() if out[key].is_nested else out[key]
            assert (one - sp2[0][f"infer_{name}_0"][key]).abs().max().item() <= 1e-5


def test_sp2_critic_values_and_value_loss_gradients_match_the_reference(sp2):
    check_critic(sp2)


def test_sp2_attention_alone_matches_plain_attention_with_gqa_and_npu_tnd(sp2):
    check_attention(sp2)


def test_sp_ranks_with_different_batches_are_refused(sp2):
    for results in sp2:
        assert "must pass the same batch" in results["different_batches"]


@pytest.mark.extended
def test_sp2_dp2_four_processes_every_mode_matches_the_reference(tmp_path_factory, reference):
    ranks = _launch(tmp_path_factory, 4, 2)
    check_modes(ranks, reference)
    check_critic(ranks)
    check_attention(ranks)
