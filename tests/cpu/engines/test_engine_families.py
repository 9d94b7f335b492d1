"""Per-family logit transforms, local checkpoints, attention masks and config validation."""
import logging
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig

from tests.helpers.engine_reference import (full_state_dict, left_right_batch, no_padding_batch, reference_logprobs,
                              reference_model, sequences)
from polyfsdp.engines.attention import VARLEN_SDPA, varlen_sdpa_mask
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.batch.micro import plan_micro_batches

TOL = 1e-5
LENGTHS = [6, 1, 12, 6, 3]
TEMPS = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0])
MODES = [(rm, fu, pm) for rm in (True, False) for fu in (True, False) for pm in ("no_padding", "left_right")]


def _check(engine, reference, seqs, modes):
    with torch.no_grad():
        exp_lp, exp_ent = reference_logprobs(reference, seqs, TEMPS.tolist())
    for rmpad, fused, pad_mode in modes:
        engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                       pad_mode=pad_mode)
        batch = (no_padding_batch if pad_mode == "no_padding" else left_right_batch)(seqs)
        out = engine.infer_batch(batch, temperature=TEMPS)
        for key, exp in (("log_probs", exp_lp), ("entropy", exp_ent)):
            got = out[key].values() if pad_mode == "no_padding" else out[key][batch["attention_mask"].bool()]
            assert (got.double() - torch.cat(exp)).abs().max() <= TOL, (key, rmpad, fused, pad_mode)


def test_gemma2_final_softcap_and_sliding_window_match_reference_in_every_mode():
    # Sequences longer than the window (4) exercise sliding-window attention in every path.
    engine = FSDPEngine(ModelConfig(preset="gemma2-tiny", seed=1), EngineConfig()).initialize()
    reference = reference_model("gemma2-tiny", full_state_dict(engine.module))
    _check(engine, reference, sequences(LENGTHS, seed=4), MODES)


def _cohere_dir(tmp_path):
    config = CohereConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          logit_scale=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    return model.eval()


def test_logit_scale_model_falls_back_to_unfused_with_one_warning(tmp_path, caplog):
    reference = _cohere_dir(tmp_path)
    engine = FSDPEngine(ModelConfig(path=str(tmp_path)), EngineConfig(use_fused_kernels=True)).initialize()
    with caplog.at_level(logging.WARNING, logger="polyfsdp.engines.engine"):
        _check(engine, reference, sequences(LENGTHS, seed=5), [(True, True, "no_padding"), (False, True, "left_right")])
    warnings = [r for r in caplog.records if "logit_scale" in r.getMessage()]
    assert len(warnings) == 1 and "unfused" in warnings[0].getMessage()


def test_missing_or_invalid_checkpoint_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        FSDPEngine(ModelConfig(path=str(tmp_path / "nope")), EngineConfig()).initialize()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        FSDPEngine(ModelConfig(path=str(tmp_path)), EngineConfig()).initialize()


def test_varlen_mask_builder_skips_the_dense_mask_unless_there_is_padding():
    assert varlen_sdpa_mask(batch_size=1, q_length=7, kv_length=7, attention_mask=None) is None
    assert varlen_sdpa_mask(batch_size=2, q_length=3, kv_length=3,
                            attention_mask=torch.ones(2, 3, dtype=torch.bool)) is None
    padded = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    mask = varlen_sdpa_mask(batch_size=2, q_length=3, kv_length=3, attention_mask=padded)
    expected = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    assert mask.shape == (2, 1, 3, 3)
    assert torch.equal(mask[1, 0], expected) and torch.equal(mask[0, 0], expected & padded[0])


def test_packed_rows_detected_from_position_ids_alone():
    # A plain HF call (no cu_seq_lens) with restarting position ids isolates the sequences.
    from polyfsdp.engines.presets import preset_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("qwen2-tiny"), attn_implementation=VARLEN_SDPA).eval()
    seqs = sequences([4, 1, 6], seed=9)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        packed = model(input_ids=torch.cat(seqs)[None], position_ids=pos, use_cache=False).logits[0]
    assert (packed - alone).abs().max() <= 1e-5


@pytest.mark.parametrize("padded", [False, True])
def test_varlen_attention_honours_sliding_window(padded):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=3, max_window_layers=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=VARLEN_SDPA).eval()
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    seqs = sequences([7, 2, 9], seed=3)
    with torch.no_grad():
        alone = [eager(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        if padded:
            ids = torch.zeros(3, 9, dtype=torch.long)
            mask = torch.zeros(3, 9, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, :len(s)], mask[i, :len(s)] = s, 1
            out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = torch.cat([out[i, :len(s)] for i, s in enumerate(seqs)])
        else:
            pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            got = model(input_ids=torch.cat(seqs)[None], position_ids=pos, use_cache=False).logits[0]
        # One sequence alone, unpadded: the window is applied by the attention function itself.
        single = model(input_ids=seqs[2][None], use_cache=False).logits[0]
    assert (got - torch.cat(alone)).abs().max() <= 1e-5
    assert (single - alone[2]).abs().max() <= 1e-5


def test_micro_batch_plan_respects_budget_and_covers_every_sequence_once():
    lengths = [7, 1, 12, 6, 6, 3, 9, 4, 20, 2]
    for budget in (1, 5, 12, 20, 25, 40, 1000):
        groups = plan_micro_batches(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert g == sorted(g)
            assert len(g) == 1 or sum(lengths[i] for i in g) <= budget
    # Balanced: 70 tokens under a budget of 25 -> 3 groups, none far below the others.
    loads = [sum(lengths[i] for i in g) for g in plan_micro_batches(lengths, 25)]
    assert len(loads) == 3 and max(loads) - min(loads) <= max(lengths)


@pytest.mark.parametrize("cls,kwargs,match", [
    ("EngineConfig", {"pad_mode": "right"}, r"EngineConfig.pad_mode: got 'right'; allowed values: 'no_padding', 'left_right'"),
    ("EngineConfig", {"param_dtype": "fp8"}, r"EngineConfig.param_dtype: got 'fp8'; allowed values: 'float32'"),
    ("EngineConfig", {"reshard_policy": "sometimes"}, r"EngineConfig.reshard_policy: got 'sometimes'; allowed values: 'default', 'always', 'never'"),
    ("EngineConfig", {"max_tokens_per_micro_batch": 0}, r"EngineConfig.max_tokens_per_micro_batch: expected >= 1"),
    ("OptimConfig", {"lr_scheduler": "linear"}, r"OptimConfig.lr_scheduler: got 'linear'; allowed values: 'constant'"),
    ("OptimConfig", {"lr_scheduler": "warmup_cosine"}, r"OptimConfig.total_steps: lr_scheduler='warmup_cosine' needs"),
    ("OptimConfig", {"betas": (0.9, 1.5)}, r"OptimConfig.betas"),
])
def test_configs_reject_bad_values_naming_field_and_choices(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        {"EngineConfig": EngineConfig, "OptimConfig": OptimConfig}[cls](**kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    # NaN passes "< 0"/"<= 0" checks and then silently turns every parameter into NaN.
    ({"lr": float("nan")}, ValueError, r"OptimConfig.lr: expected a finite number >= 0, got nan"),
    ({"grad_clip": float("nan")}, ValueError, r"OptimConfig.grad_clip: expected a finite number > 0 or None"),
    ({"grad_clip": float("inf")}, ValueError, r"OptimConfig.grad_clip: expected a finite number > 0 or None"),
    ({"weight_decay": -0.1}, ValueError, r"OptimConfig.weight_decay: expected a finite number >= 0, got -0.1"),
    ({"eps": 0.0}, ValueError, r"OptimConfig.eps: expected a finite number > 0, got 0.0"),
    ({"min_lr_ratio": "0.1"}, TypeError, r"OptimConfig.min_lr_ratio: expected a number"),
    ({"lr_scheduler": "warmup_cosine", "total_steps": 10.5}, TypeError, r"OptimConfig.total_steps: expected"),
    ({"lr_scheduler": "warmup_cosine", "total_steps": "10"}, TypeError, r"OptimConfig.total_steps: expected"),
    ({"betas": 0.9}, ValueError, r"OptimConfig.betas: expected two numbers in \[0, 1\), got 0.9"),
    ({"betas": ("a", "b")}, ValueError, r"OptimConfig.betas: expected two numbers in \[0, 1\)"),
])
def test_optim_config_rejects_non_finite_or_mistyped_numbers_naming_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        OptimConfig(**kwargs)


def test_config_from_dict_rejects_unknown_keys_and_names_fields_by_the_callers_path():
    with pytest.raises(ValueError, match=r"EngineConfig.use_rmpad: unknown key; known keys: "):
        EngineConfig.from_dict({"use_rmpad": True})
    with pytest.raises(ValueError, match=r"^algo.sft.optim.lr: expected a finite number >= 0, got -1"):
        OptimConfig.from_dict({"lr": -1.0}, where="algo.sft.optim")
    with pytest.raises(TypeError, match=r"^engine.use_fused_kernels: expected a bool"):
        EngineConfig.from_dict({"use_fused_kernels": "yes"}, where="engine")
    assert OptimConfig.from_dict({"betas": [0.8, 0.9]}).betas == (0.8, 0.9)
    with pytest.raises(ValueError, match="set exactly one of preset or path"):
        ModelConfig()
    with pytest.raises(ValueError, match=r"ModelConfig.preset: got 'gpt5'; allowed values:"):
        ModelConfig(preset="gpt5")
    with pytest.raises(TypeError, match="EngineConfig.use_fused_kernels: expected a bool"):
        EngineConfig(use_fused_kernels="yes")


def test_lr_schedules_follow_warmup_and_cosine():
    import math

    from polyfsdp.engines.model.optim import lr_factor

    cfg = OptimConfig(lr_scheduler="warmup_cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    got = [lr_factor(s, cfg) for s in range(7)]
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert got == pytest.approx([0.5, 1.0] + cosine)
    assert [lr_factor(s, OptimConfig(warmup_steps=2)) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
