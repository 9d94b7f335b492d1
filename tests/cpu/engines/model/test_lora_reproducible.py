"""LoRA runs are reproducible: adapters are drawn from a generator seeded from the model seed
(not whatever state the process's generator is in), LoRA dropout is seeded per step, so two
runs of one seed are identical from SFT step 1, and a run continued at the start of its RL
phase draws the same adapters as one that never stopped."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tests.cpu.trainer.test_cli import _comparable

from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main

pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")

LORA = ["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
        "data.eval_size=4", "trainer.progress=off", "trainer.plot=false", "algo.actor.group_size=4",
        "trainer.checkpoint_interval=0", "model.lora.rank=4", "model.lora.dropout=0.1"]


def _adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_adapters_come_from_the_seed_and_leave_the_callers_generator_alone():
    from transformers import AutoModelForCausalLM

    from polyfsdp.engines.config import LoraConfig
    from polyfsdp.engines.model.lora import add_adapters
    from polyfsdp.engines.presets import preset_config

    def adapted(seed, generator_seed):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(preset_config("qwen2-tiny"))
        torch.manual_seed(generator_seed)  # the process's generator, in some state
        before = torch.get_rng_state()
        add_adapters(model, LoraConfig(rank=4), seed=seed)
        assert torch.equal(torch.get_rng_state(), before)  # neither decides nor advances
        return _adapters(model)

    first, again, other = adapted(7, 1), adapted(7, 2), adapted(8, 1)
    assert first.keys() == again.keys() and any("lora_A" in n for n in first)
    for name in first:
        assert torch.equal(first[name], again[name]), name
    assert any(not torch.equal(first[n], other[n]) for n in first if "lora_A" in n)


def _records(out):
    return _comparable(read_metrics(str(out / "metrics.jsonl")))


def _assert_same_export(a, b):
    expected, got = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "uninterrupted"
    assert main([*LORA, f"trainer.output_dir={out}"]) == 0
    return out


def test_two_runs_of_one_seed_in_two_processes_are_identical(reference, tmp_path):
    out = tmp_path / "second"
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *LORA, f"trainer.output_dir={out}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "POLYFSDP_BACKEND": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _records(out) == _records(reference)
    _assert_same_export(reference, out)


def test_a_run_continued_at_the_start_of_its_rl_phase_equals_the_uninterrupted_one(reference, tmp_path, monkeypatch):
    from polyfsdp.trainer.algos import rl_step as rl_step_module

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C in the first GRPO step: the SFT export is there, no GRPO checkpoint

    out = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        patch.setattr(rl_step_module, "rl_step", stopped)
        assert main([*LORA, f"trainer.output_dir={out}"]) == 130
    assert (out / "sft_model").is_dir() and not (out / "checkpoints" / "rl").exists()
    torch.manual_seed(12345)  # whatever the generator holds, the continued run draws the same adapters
    assert main([*LORA, f"trainer.output_dir={out}", "trainer.resume=auto"]) == 0
    assert _records(out) == _records(reference)
    _assert_same_export(reference, out)
