"""polyfsdp-train with LoRA (model.lora.rank) and --estimate: SFT then GRPO trains adapters
only, GRPO's KL reference is the policy with adapters off, the final export is a peft adapter
directory that loads back; the memory table prints without a run."""
from __future__ import annotations

import json

import pytest

from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.train import main

TINY = ["trainer.sft_steps=2", "trainer.rl_steps=1", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
        "data.eval_size=4", "trainer.progress=lines", "algo.actor.group_size=4"]



def test_lora_keys_reach_the_engine_and_bad_ones_are_one_line():
    pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    cfg = load_config(["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"])
    lora = cfg.model.model_config().lora
    assert (lora.rank, lora.target_modules) == (8, ("q_proj", "v_proj"))
    assert not load_config([]).model.model_config().lora.enabled
    with pytest.raises(ConfigError, match="trainer.export_lora"):
        load_config(["trainer.export_lora=adapter"])
    with pytest.raises(ConfigError, match="trainer.export_lora"):
        load_config(["model.lora.rank=8", "trainer.export_lora=both"])


def test_lora_without_peft_is_one_line_at_start(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ConfigError, match=r"needs peft.*pip install"):
        load_config(["model.lora.rank=8"])


def test_estimate_prints_the_table_and_builds_nothing(tmp_path, capsys):
    pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    out = tmp_path / "run"
    code = main(["model.lora.rank=8", "engine.max_tokens_per_micro_batch=512", f"trainer.output_dir={out}",
                 "--estimate"])
    assert code == 0
    text = capsys.readouterr().out
    assert "LoRA rank 8" in text and "micro-batch budget 512" in text
    assert "policy AdamW state" in text and "actor update micro-batch" in text and "peak over phases" in text
    assert "reference parameters" not in text  # the adapters-off policy is the reference
    assert not out.exists()  # no run started


def test_sft_then_grpo_with_lora_exports_a_peft_adapter(tmp_path, capsys):
    pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert main([*TINY, "model.lora.rank=4", "trainer.export_lora=adapter", f"trainer.output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "[rl reference]" not in text  # the reference is the policy with adapters off
    assert "[sft policy] trainable parameters: " in text and "[rl policy] trainable parameters: " in text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["phase"] == "rl" for r in records)
    # GRPO started from the merged SFT model: a plain checkpoint, which the adapter goes on.
    base = AutoModelForCausalLM.from_pretrained(out / "sft_model")
    assert not any(".lora_" in n for n, _ in base.named_parameters())
    loaded = PeftModel.from_pretrained(base, out / "final")
    assert any(".lora_A." in n for n, _ in loaded.named_parameters())
