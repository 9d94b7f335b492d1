"""``polyfsdp-train ... --estimate`` covers the job it is asked about (trainer/run/estimate.py): its
live peak is within 30% of the measured peak-RSS rise of SFT, GRPO, PPO and LoRA jobs on CPU
(benchmarks/job_memory.py, a model the per-token figures were not fitted to), the RL phase
counts its rollout rows, reference copy and critic, and a config-only 7B directory gives
the published 16 bytes per parameter of mixed-precision AdamW, not terabytes."""
import json
import os
import sys

import pytest

from tests.helpers import ROOT
from polyfsdp.trainer.config.job import load_config
from polyfsdp.engines.memory import ModelMemory
from polyfsdp.trainer.run.estimate import _hf_config, _Lengths, estimate_job
from polyfsdp.trainer.train import main

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

GIB = 2 ** 30
# Qwen2-7B's shape (config only: nothing is built or downloaded).
QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": 151643, "eos_token_id": 151643}


@pytest.fixture
def qwen2_7b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_7B))
    return str(tmp_path)


@pytest.mark.parametrize("job", ["sft", "grpo", "ppo", "lora grpo"])
def test_job_peak_is_within_30_percent_of_the_measured_rss_rise(job, tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the peak RSS")
    if "lora" in job:
        pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    import job_memory

    out = job_memory.run_job(job, str(tmp_path / "run"))
    assert 0.7 <= out["estimated"] / out["measured"] <= 1.3, out


def _steps(est, phase):
    return {s.name: s for s in est.steps[phase]}


def test_rl_phase_counts_rollout_rows_reference_and_critic():
    base = ["trainer.prompts_per_step=32", "algo.actor.group_size=8", "algo.actor.max_new_tokens=8"]
    grpo = estimate_job(load_config(base), world_size=1)
    rollout = _steps(grpo, "grpo")["rollout generation (KV cache)"]
    assert rollout.rows == 32 * 8
    assert _steps(estimate_job(load_config(base), world_size=2), "grpo")["rollout generation (KV cache)"].rows == 128
    assert "reference parameters (a frozen copy)" in grpo.state["grpo"]
    # Several ranks: rollout.unshard gathers the whole model for generation, false gathers the
    # root and two layers at a time (FSDP2's forward).
    gathered, per_layer = (_steps(estimate_job(load_config([*base, f"rollout.unshard={u}"]), world_size=2), "grpo")
                           ["rollout generation (KV cache)"].transient for u in ("auto", "false"))
    cfg = load_config(base)
    hf_config = _hf_config(cfg, _Lengths(cfg).tokenizer)
    fsdp_forward = ModelMemory(cfg.model.model_config(), cfg.engine, 2, hf_config).fsdp_forward
    assert 0 < fsdp_forward and gathered - per_layer + fsdp_forward == grpo.state["grpo"]["policy parameters"]
    ppo = estimate_job(load_config(["algo=ppo", *base]), world_size=1)
    assert {"critic parameters", "critic AdamW state"} <= set(ppo.state["ppo"])
    assert {"critic values pass (no grad)", "critic update micro-batch"} <= set(_steps(ppo, "ppo"))
    assert ppo.peak()[0] > grpo.peak()[0]
    lora = estimate_job(load_config(["model.lora.rank=8", *base]), world_size=1)
    assert not any("reference" in name for name in lora.state["grpo"])  # adapters off: no copy
    # The rollout's micro-batch follows the engine's token budget.
    budget = estimate_job(load_config([*base, "engine.max_tokens_per_micro_batch=512"]), world_size=1)
    assert _steps(budget, "grpo")["actor update micro-batch"].tokens <= 512
    assert _steps(grpo, "grpo")["actor update micro-batch"].tokens > 512


def test_offload_moves_state_off_the_device_except_on_the_cpu_backend():
    def state(*overrides):
        return estimate_job(load_config(list(overrides)), world_size=1).state["grpo"]

    kept = state("backend=cuda")  # a named GPU backend is estimated as such on any machine
    optimizer = state("backend=cuda", "engine.offload=optimizer")
    params = state("backend=cuda", "engine.offload=params")
    assert kept["policy AdamW state"] > 0 and optimizer["policy AdamW state"] == 0
    assert optimizer["policy parameters"] == kept["policy parameters"]
    assert all(value == 0 for value in params.values())
    assert state("backend=cpu", "engine.offload=params") == state("backend=cpu")  # a no-op on the CPU
    from polyfsdp.backends.registry import get_backend

    if get_backend("auto").memory_is_host:  # backend=auto resolves as the job would resolve it
        assert state("engine.offload=params") == state()


def test_a_7b_config_gives_16_bytes_per_parameter_and_no_terabytes(qwen2_7b):
    # ZeRO (Rajbhandari et al. 2019, section 3.1): mixed-precision AdamW holds 16 bytes per
    # parameter (2 + 2 + 12); fp32 master weights, gradients and two moments are the same 16.
    cfg = load_config([f"model.path={qwen2_7b}", "model.dtype=float32", "engine.param_dtype=bfloat16"])
    est = estimate_job(cfg, world_size=64)
    params = 7_615_616_512  # Qwen2-7B
    state = est.state["grpo"]
    per_param = (state["policy parameters"] + state["policy gradients (during the update)"]
                 + state["policy AdamW state"]) * 64 / params
    assert 16.0 <= per_param < 16.05, per_param
    # ZeRO's 7.5B example on 64 GPUs with P_os+g+p: 1.88 GB of model state per GPU.
    assert 1.85e9 < (per_param * params / 64) < 1.95e9
    # The case (bf16, one rank) printed ~16 TiB: the micro-batch is now the job's own.
    bf16 = estimate_job(load_config([f"model.path={qwen2_7b}", "model.dtype=bfloat16",
                                     "engine.param_dtype=bfloat16"]), world_size=1)
    peak, _ = bf16.peak()
    assert 60 * GIB < peak < 200 * GIB, peak / GIB


def test_command_line_prints_phases_and_the_peak(qwen2_7b, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([f"model.path={qwen2_7b}", "algo=ppo", f"trainer.output_dir={out}", "--estimate"]) == 0
    text = capsys.readouterr().out
    for line in ("sft phase", "ppo phase", "rollout generation (KV cache)", "critic update micro-batch",
                 "peak over phases", "has no tokenizer"):
        assert line in text
    assert not out.exists()
