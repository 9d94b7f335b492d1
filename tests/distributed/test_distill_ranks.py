"""On-policy distillation (``algo.distill``) on several ranks (torchrun, gloo, CPU): the teacher
is a second frozen engine sharded like the reference, and its log-prob pass goes through the
same engine paths. So one SFT and one RL step of a LoRA student with the reverse-KL advantage
mixed into GRPO's end with the parameters of one rank (1e-5) on 2 ranks with
``engine.ulysses_sp_size=2`` (one replica, the SP engine), and on 2 data-parallel replicas
(rows seeded globally: the same completions), with the same ``distill/reverse_kl``.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from test_trainer_sequence_parallel import TOL, _launch, _max_diff, _records, _weights
from polyfsdp.engines.presets import preset_config
from polyfsdp.trainer.data.tokenizers import CharTokenizer

# A LoRA student (its KL reference is its adapters off; the teacher never gets adapters).
STUDENT = ["model.lora.rank=4", "algo.distill.coef=0.5"]


def _teacher(directory) -> str:
    """Another model with the built-in task's character tokenizer, so the rows' KL is far from 0."""
    tokenizer = CharTokenizer()
    config = preset_config("qwen2-tiny", vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def test_distillation_on_sp2_and_on_two_replicas_equals_one_rank(tmp_path):
    teacher = f"algo.distill.teacher={_teacher(tmp_path / 'teacher')}"
    one, sp2, dp2 = tmp_path / "one", tmp_path / "sp2", tmp_path / "dp2"
    _launch(one, 1, *STUDENT, teacher)
    shown = _launch(sp2, 2, *STUDENT, teacher, "engine.ulysses_sp_size=2")
    assert "1 replica(s) x sequence-parallel 2" in shown.stdout
    _launch(dp2, 2, *STUDENT, teacher)
    start = load_file(str(one / "init_model" / "model.safetensors"))
    final_one = _weights(one)
    moved = _max_diff({k: final_one[k] for k in start}, start)
    assert moved > 100 * TOL, f"the steps must move the weights well beyond the tolerance (moved {moved:.3g})"
    r1 = _records(one, "rl")[0]
    assert abs(r1["distill/reverse_kl"]) > 0.01 and 0 < r1["distill/adv_share"] < 1, r1
    for other in (sp2, dp2):
        r2 = _records(other, "rl")[0]
        for key in ("reward", "loss", "grad_norm", "distill/reverse_kl", "distill/adv_share"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-5, abs=1e-7), (other.name, key)
        assert _max_diff(_weights(other), final_one) <= TOL, other.name
