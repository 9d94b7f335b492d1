"""engines/memory.py: parameter, gradient and optimizer figures exactly equal a built tiny
model's; the step's activation + head estimate within 30% of the measured peak-RSS rise on
CPU (benchmarks/memory_table.py's child process); the command line prints the table."""
import os
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers import ROOT
from tests.helpers.engine_cases import masks_for
from tests.helpers.engine_reference import no_padding_batch, sequences
from polyfsdp.engines.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import SFTLoss
from polyfsdp.engines.memory import estimate_memory, main, shard_numel

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors):
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_parameter_gradient_and_optimizer_figures_equal_a_built_model(lora_rank):
    if lora_rank:
        pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    model_config = ModelConfig(preset="qwen2-tiny-tied", lora=LoraConfig(rank=lora_rank))
    engine_config = EngineConfig()
    rows = estimate_memory(model_config, engine_config, world_size=1, tokens=64).rows
    engine = FSDPEngine(model_config, engine_config, OptimConfig(lr=1e-3)).initialize()
    assert rows["parameters (sharded, master dtype)"] == _nbytes(engine.module.parameters())
    seqs = sequences([6, 9, 4], seed=1)
    engine.forward_backward(no_padding_batch(seqs, per_token={"response_mask": masks_for(seqs)}), SFTLoss())
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    assert rows["gradients (trainable only)"] == _nbytes(grads)
    engine.optimizer_step()
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert rows["optimizer state (AdamW, trainable only)"] == _nbytes(state)
    if lora_rank:  # negative control: the adapters are a small part of the model
        assert rows["gradients (trainable only)"] * 4 < rows["parameters (sharded, master dtype)"]


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_a_vision_language_models_figures_equal_the_built_model(freeze_vision):
    """Qwen2-VL (its own model class, the text decoder's dims in text_config): parameters,
    gradients and AdamW state equal the engine's after one step on rows with images; a frozen
    tower leaves the estimate's gradients and optimizer state as the engine's."""
    from tests.helpers.vlm_reference import vlm_batch, vlm_sequences

    model_config = ModelConfig(preset="qwen2-vl-tiny", freeze_vision=freeze_vision)
    engine_config = EngineConfig()
    rows = estimate_memory(model_config, engine_config, world_size=1, tokens=64).rows
    engine = FSDPEngine(model_config, engine_config, OptimConfig(lr=1e-3)).initialize()
    assert rows["parameters (sharded, master dtype)"] == _nbytes(engine.module.parameters())
    seqs = vlm_sequences([["small"], ["wide", "square"], []], seed=1)
    masks = [torch.ones(len(s["ids"]), dtype=torch.bool) for s in seqs]
    engine.forward_backward(vlm_batch(seqs, "no_padding", per_token={"response_mask": masks}), SFTLoss())
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    assert rows["gradients (trainable only)"] == _nbytes(grads)
    engine.optimizer_step()
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert rows["optimizer state (AdamW, trainable only)"] == _nbytes(state)


def test_sharding_pads_dim_zero_to_the_world_size():
    assert shard_numel(torch.Size([5, 3]), 2) == 9  # rows 3 + 2, padded to 3 per rank
    assert shard_numel(torch.Size([8]), 4) == 2
    assert shard_numel(torch.Size([]), 8) == 1
    one = estimate_memory(ModelConfig(preset="qwen2-tiny"), EngineConfig(), 1, 16).rows
    four = estimate_memory(ModelConfig(preset="qwen2-tiny"), EngineConfig(), 4, 16).rows
    params = "parameters (sharded, master dtype)"
    assert one[params] / 4 <= four[params] < one[params] / 4 * 1.1


@pytest.mark.parametrize("case", [("full", 0, False, False), ("lora, checkpointed", 8, True, False)],
                         ids=lambda c: c[0])
def test_step_estimate_is_within_30_percent_of_the_measured_rss_rise(case):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the peak RSS")
    if case[1]:
        pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    import memory_table

    out = memory_table.run_case("qwen2-small", 1024, *case[1:])
    estimated = memory_table.step_estimate(out["rows"])
    assert 0.7 <= estimated / out["measured_rise"] <= 1.3, (estimated, out["measured_rise"])


def test_command_line_prints_the_table(capsys):
    assert main(["--preset", "qwen2-tiny", "--tokens", "256", "--world-size", "2", "--fused"]) == 0
    out = capsys.readouterr().out
    assert "parameters (sharded, master dtype)" in out and "logits the fused head avoids" in out
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(ModelConfig(preset="qwen2-tiny"), EngineConfig(), 0, 16)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        estimate_memory(ModelConfig(preset="qwen2-tiny"), EngineConfig(), 1)
