"""LoRA through peft under FSDP2 (engines/model/lora.py): frozen base, optimizer over adapters only,
the adapters-off reference, all 8 modes against a per-sequence reference whose adapters are
merged by hand, checkpoints of what is trained, and both export formats."""
from dataclasses import replace

import pytest
import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from tests.helpers.engine_reference import (full_state_dict, left_right_batch, no_padding_batch, per_sequence, reference_logprobs,
                              reference_model, sequences)
from tests.helpers.lora_reference import base_only, merged_by_hand, randomize_adapters
from polyfsdp.engines.config import ConfigFieldError, EngineConfig, LoraConfig, ModelConfig, OptimConfig
from polyfsdp.engines.losses import SFTLoss

peft = pytest.importorskip("peft", reason="LoRA tests need peft (pip install -e '.[lora]')")

from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

TOL = 1e-5
RANK, ALPHA = 4, 8.0
LENGTHS = [6, 1, 12, 6, 3]
TEMPS = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0])
MODES = [(rm, fu, pad) for rm in (True, False) for fu in (True, False) for pad in ("no_padding", "left_right")]


def lora_engine(preset="qwen2-tiny", lr=1e-2, **lora):
    settings = dict(rank=RANK, alpha=ALPHA) | lora
    return FSDPEngine(ModelConfig(preset=preset, seed=3, lora=LoraConfig(**settings)), EngineConfig(),
                      OptimConfig(lr=lr, grad_clip=None)).initialize()


def build(seqs, pad_mode, **kw):
    return (no_padding_batch if pad_mode == "no_padding" else left_right_batch)(seqs, **kw)


def sft_batch(seqs):
    masks = [torch.ones(len(s)) for s in seqs]
    for m in masks:
        m[-1] = 0
    return no_padding_batch(seqs, per_token={"response_mask": masks})


@pytest.fixture(scope="module", params=["qwen2-tiny", "qwen2-tiny-tied"])
def adapted(request):
    """An engine with random adapters, its merged-by-hand and base-only references."""
    engine = lora_engine(request.param)
    randomize_adapters(engine.module, seed=1)
    state = full_state_dict(engine.module)
    merged = reference_model(request.param, merged_by_hand(state, RANK, ALPHA))
    base = reference_model(request.param, base_only(state))
    return engine, merged, base


def test_config_errors_name_the_field():
    for bad, match in (({"rank": -1}, "lora.rank"), ({"dropout": 1.0}, "lora.dropout"),
                       ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"), ({"alpha": 0}, "lora.alpha"),
                       ({"target_modules": []}, "target_modules"), ({"rnak": 8}, "unknown key")):
        with pytest.raises(ConfigFieldError, match=match):
            ModelConfig.from_dict({"preset": "qwen2-tiny", "lora": bad}, where="model")
    with pytest.raises(ConfigFieldError, match=r"^model\.lora\.rank:"):
        ModelConfig.from_dict({"preset": "qwen2-tiny", "lora": {"rank": -2}}, where="model")
    assert not ModelConfig(preset="qwen2-tiny").lora.enabled
    assert ModelConfig(preset="qwen2-tiny", lora={"rank": 2, "target_modules": "q_proj"}).lora.target_modules == \
        ("q_proj",)


def test_parameter_counts_are_the_adapters_of_rank_r_and_the_whole_model():
    """Trained: r x (in + out) per adapted linear of the plain model, counted here by hand."""
    from transformers import AutoModelForCausalLM

    from polyfsdp.engines.presets import PRESETS

    plain = AutoModelForCausalLM.from_config(PRESETS["qwen2-tiny"]())
    linears = [m for name, m in plain.named_modules() if isinstance(m, torch.nn.Linear)
               and name.rsplit(".", 1)[-1] in ("q_proj", "v_proj")]
    engine = lora_engine(target_modules=["q_proj", "v_proj"])
    adapters = sum(RANK * (m.in_features + m.out_features) for m in linears)
    assert engine.parameter_counts() == (adapters, sum(p.numel() for p in plain.parameters()) + adapters)
    full = FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig(), OptimConfig()).initialize()
    assert full.parameter_counts() == (sum(p.numel() for p in plain.parameters()),) * 2


def test_adding_and_exporting_adapters_raises_no_deprecation_from_peft(tmp_path):
    """peft reads transformers' deprecated is_gradient_checkpointing: not the user's warning."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = lora_engine()
        engine.export_hf(str(tmp_path / "merged"))
        warnings.warn("still shown", FutureWarning)  # the filter is the one message's, not all
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "is_gradient_checkpointing" in m], messages
    assert "still shown" in messages


def test_missing_peft_is_one_clear_line(monkeypatch):
    import sys

    from polyfsdp.engines.model.lora import add_adapters

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ImportError, match=r"needs peft.*pip install -e \"\.\[lora\]\""):
        add_adapters(torch.nn.Linear(2, 2), LoraConfig(rank=2))


def test_base_is_frozen_and_the_optimizer_holds_only_adapters():
    engine = lora_engine(target_modules=["q_proj", "v_proj"])
    named = dict(engine.module.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(("q_proj" in n or "v_proj" in n) for n in trainable)
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(named[n]) for n in trainable}

    before = full_state_dict(engine.module)
    metrics = engine.train_batch(sft_batch(sequences(LENGTHS, seed=2)), SFTLoss())
    assert metrics["grad_norm"] > 0
    after = full_state_dict(engine.module)
    state_owners = {id(p) for p in engine.optimizer.state}
    assert state_owners == in_optimizer  # AdamW moments exist for the adapters only
    for name, value in after.items():
        if name in trainable and ".lora_B." in name:  # B starts at 0 and gets a non-zero gradient
            assert not torch.equal(value, before[name]), name
        elif name not in trainable:
            assert torch.equal(value, before[name]), f"frozen {name} changed"


@pytest.mark.parametrize("rmpad,fused,pad_mode", MODES)
def test_every_mode_matches_the_merged_per_sequence_reference(adapted, rmpad, fused, pad_mode):
    engine, merged, base = adapted
    engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                   pad_mode=pad_mode)
    seqs = sequences(LENGTHS, seed=11)
    batch = build(seqs, pad_mode)
    out = engine.infer_batch(batch, temperature=TEMPS)
    with torch.no_grad():
        want_lp, want_ent = reference_logprobs(merged, seqs, TEMPS.tolist())
        base_lp, _ = reference_logprobs(base, seqs, TEMPS.tolist())
    got_lp = torch.cat(per_sequence(out["log_probs"], batch, pad_mode)).double()
    got_ent = torch.cat(per_sequence(out["entropy"], batch, pad_mode)).double()
    assert (got_lp - torch.cat(want_lp)).abs().max() <= TOL
    assert (got_ent - torch.cat(want_ent)).abs().max() <= TOL
    # Negative control: the adapters change the numbers far beyond the tolerance.
    assert (got_lp - torch.cat(base_lp)).abs().max() > 100 * TOL

    off = engine.infer_batch(batch, temperature=TEMPS, adapters=False)
    off_lp = torch.cat(per_sequence(off["log_probs"], batch, pad_mode)).double()
    assert (off_lp - torch.cat(base_lp)).abs().max() <= TOL
    # The context manager restores the adapters.
    again = torch.cat(per_sequence(engine.infer_batch(batch, temperature=TEMPS)["log_probs"], batch, pad_mode))
    assert torch.equal(again.double(), got_lp)


def test_adapters_off_equals_a_separate_engine_without_lora():
    engine = lora_engine()
    randomize_adapters(engine.module, seed=4)
    plain = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=3), EngineConfig()).initialize()
    batch = no_padding_batch(sequences(LENGTHS, seed=5))
    with engine.adapters_disabled():
        off = engine.infer_batch(batch)["log_probs"].values()
    assert (off - plain.infer_batch(batch)["log_probs"].values()).abs().max() <= TOL
    # What the separate reference engine costs: every base parameter a second time.
    extra = sum(p.numel() for p in plain.module.parameters())
    adapters = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    assert adapters < extra


def _dcp_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_checkpoint_saves_only_adapters_and_resumes_exactly(tmp_path):
    seqs = [sequences(LENGTHS, seed=20 + i) for i in range(3)]
    first = lora_engine(lr=1e-3)
    first.train_batch(sft_batch(seqs[0]), SFTLoss())
    path = first.save_checkpoint(tmp_path)
    keys = _dcp_keys(path)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_" in k for k in model_keys), sorted(model_keys)[:5]
    assert any(k.startswith("optim.") for k in keys)
    for batch_seqs in seqs[1:]:
        first.train_batch(sft_batch(batch_seqs), SFTLoss())

    second = lora_engine(lr=1e-3)
    second.load_checkpoint(tmp_path)
    for batch_seqs in seqs[1:]:
        second.train_batch(sft_batch(batch_seqs), SFTLoss())
    a, b = full_state_dict(first.module), full_state_dict(second.module)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # Negative control: an engine that did not load differs.
    third = lora_engine(lr=1e-3)
    for batch_seqs in seqs[1:]:
        third.train_batch(sft_batch(batch_seqs), SFTLoss())
    assert not all(torch.equal(a[k], v) for k, v in full_state_dict(third.module).items())


def _per_sequence_logprobs(model, seqs):
    with torch.no_grad():
        return torch.cat(reference_logprobs(model, seqs, [1.0] * len(seqs))[0])


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen2-tiny-tied"])
def test_export_merged_and_adapter_load_back_with_the_same_log_probs(tmp_path, preset):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from polyfsdp.engines.presets import preset_config

    engine = lora_engine(preset)
    randomize_adapters(engine.module, seed=6)
    seqs = sequences(LENGTHS, seed=7)
    want = engine.infer_batch(no_padding_batch(seqs))["log_probs"].values().double()

    engine.export_hf(tmp_path / "merged", lora="merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    assert (_per_sequence_logprobs(merged, seqs) - want).abs().max() <= TOL

    engine.export_hf(tmp_path / "adapter", lora="adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_config(preset_config(preset))
    base.load_state_dict(base_only(full_state_dict(engine.module)), strict=False)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert (_per_sequence_logprobs(loaded, seqs) - want).abs().max() <= TOL
    with loaded.disable_adapter():  # negative control
        assert (_per_sequence_logprobs(loaded, seqs) - want).abs().max() > 100 * TOL


def test_adapter_export_without_lora_is_refused(tmp_path):
    plain = FSDPEngine(ModelConfig(preset="qwen2-tiny"), EngineConfig()).initialize()
    with pytest.raises(ValueError, match="needs a LoRA model"):
        plain.export_hf(tmp_path, lora="adapter")


def test_bf16_base_with_fp32_adapters_trains():
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", dtype="bfloat16", lora=LoraConfig(rank=RANK)),
                        EngineConfig(param_dtype="bfloat16"), OptimConfig(lr=1e-2)).initialize()
    dtypes = {n: (p.to_local() if isinstance(p, DTensor) else p).dtype for n, p in engine.module.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    batch = sft_batch(sequences(LENGTHS, seed=9))
    first = engine.train_batch(batch, SFTLoss())
    second = engine.train_batch(batch, SFTLoss())
    assert torch.isfinite(torch.tensor([first["loss"], second["loss"]])).all()
    assert second["loss"] < first["loss"]


def test_lora_dropout_is_active_in_training_only():
    engine = lora_engine(dropout=0.5)
    randomize_adapters(engine.module, seed=8)
    batch = no_padding_batch(sequences(LENGTHS, seed=3))
    a = engine.infer_batch(batch)["log_probs"].values()
    b = engine.infer_batch(batch)["log_probs"].values()
    assert torch.equal(a, b)  # infer_batch runs in eval mode: no dropout
    flat_batch = TensorDict({"input_ids": batch["input_ids"]}, batch_size=[len(LENGTHS)])
    from polyfsdp.engines.batch.flat import batch_to_flat

    flat = batch_to_flat(flat_batch, "no_padding")
    with torch.no_grad(), engine.train_mode():
        c, _ = engine.forward_flat(flat, return_entropy=False)
    assert not torch.allclose(c, a, atol=1e-4)
