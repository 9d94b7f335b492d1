"""engines/memory_vision.py: the vision tower's saved activations equal (float32, to 0.5%; 2% in
bfloat16) the bytes autograd keeps inside the tower during the engine's forward_backward, counted
by ``torch.autograd.graph.saved_tensors_hooks`` (each storage once, parameters left out), on the
three tiny presets, with and without ``freeze_vision`` (and activation checkpointing); a step
with images is within 30% of the measured peak-RSS rise, as the decoder's estimate is."""
import os
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers import ROOT
from tests.helpers.vlm_reference import VLM_PRESETS, vlm_batch, vlm_sequences
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import SFTLoss
from polyfsdp.engines.memory import ModelMemory, estimate_memory
from polyfsdp.engines.parallel.fsdp import vision_tower

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
IMAGES = [["square", "square"], ["wide", "square"], []]  # 16 + 16 + 8 + 16 = 56 patches, a text-only row


def _storage(t: torch.Tensor):
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def measured_tower_saved(engine) -> tuple[int, int]:
    """``(bytes, patches)``: the storages autograd saves while the tower runs forward (each once;
    parameters, and FSDP2's gathered copies of them, are not activations)."""
    tower, seen, hooks = vision_tower(engine.module), {}, []

    def pack(t):
        params = {_storage(p).data_ptr() for p in engine.module.parameters()}  # the gathered ones while they run
        storage = _storage(t)
        if not isinstance(t, torch.nn.Parameter) and storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    def enter(module, args, kwargs):
        hooks.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        hooks[-1].__enter__()

    handles = [tower.register_forward_pre_hook(enter, with_kwargs=True),
               tower.register_forward_hook(lambda *a, **k: hooks.pop().__exit__(None, None, None), with_kwargs=True)]
    seqs = vlm_sequences(IMAGES, seed=1)
    masks = [torch.ones(len(s["ids"]), dtype=torch.bool) for s in seqs]
    try:
        engine.forward_backward(vlm_batch(seqs, "no_padding", per_token={"response_mask": masks}), SFTLoss())
    finally:
        for handle in handles:
            handle.remove()
    return sum(seen.values()), sum(len(s["pixels"]) for s in seqs)


CASES = [(preset, freeze, "float32", False) for preset in VLM_PRESETS for freeze in (False, True)] + \
    [(preset, False, "bfloat16", False) for preset in VLM_PRESETS] + \
    [(preset, freeze, "float32", True) for preset in ("qwen2-vl-tiny", "qwen3-vl-tiny") for freeze in (False, True)]


@pytest.mark.parametrize("preset,freeze,dtype,checkpointing", CASES, ids=lambda v: str(v))
def test_tower_saved_bytes_equal_what_autograd_keeps(preset, freeze, dtype, checkpointing):
    model_config = ModelConfig(preset=preset, freeze_vision=freeze)
    engine_config = EngineConfig(param_dtype=dtype, gradient_checkpointing=checkpointing)
    engine = FSDPEngine(model_config, engine_config, OptimConfig(lr=1e-3)).initialize()
    measured, patches = measured_tower_saved(engine)
    tower = ModelMemory(model_config, engine_config).tower
    estimated = tower.saved(patches, checkpointing)
    if checkpointing and not freeze:  # the rotary cos and sin a checkpoint holds as inputs: counted, not saved
        estimated -= patches * 2 * (tower.shape.width // tower.shape.heads) * 4
    if dtype == "float32" and not freeze:  # the convolution keeps the batch's own pixel rows: no new bytes
        measured -= patches * tower.shape.pixels * 4
    # float32: Qwen2.5-VL's int64 window indices are left out (0.04%; 0.4% frozen). bfloat16:
    # LayerNorm's mean and rstd are counted in float32, which CUDA keeps them in and the CPU does not.
    tolerance = 0.02 if dtype == "bfloat16" else 0.005
    assert abs(estimated - measured) <= tolerance * measured, (estimated, measured)


def test_a_frozen_tower_keeps_only_its_mergers_and_the_step_counts_the_tower():
    """Negative control: without freeze_vision the blocks' tensors are 9.6x the mergers'; the
    step row adds the tower's saved bytes on top of the decoder's (none for 0 patches)."""
    trained = ModelMemory(ModelConfig(preset="qwen2-vl-tiny"), EngineConfig()).tower
    frozen = ModelMemory(ModelConfig(preset="qwen2-vl-tiny", freeze_vision=True), EngineConfig()).tower
    assert trained.saved(56) > 9 * frozen.saved(56) > 0
    step = "step activations + head (as configured)"
    text = estimate_memory(ModelConfig(preset="qwen2-vl-tiny"), EngineConfig(), tokens=512).rows
    images = estimate_memory(ModelConfig(preset="qwen2-vl-tiny"), EngineConfig(), tokens=512, patches=256).rows
    assert images[step] == text[step] + images["vision tower saved, 256 patches"] == text[step] + trained.saved(256)
    assert "vision tower saved, 0 patches" not in text


@pytest.mark.parametrize("freeze", [False, True], ids=["trained tower", "frozen tower"])
def test_step_estimate_with_images_is_within_30_percent_of_the_measured_rss_rise(freeze):
    """As test_memory_estimate's decoder check (benchmarks/memory_table.py's child process): 16
    112x112 images (1024 patches) in 544 tokens; without the tower's rows the estimate would be
    under half the rise (the negative control, trained tower)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the peak RSS")
    import memory_table

    out = memory_table.run_vlm_case("qwen2-vl-tiny", 16, freeze)
    estimated = memory_table.step_estimate(out["rows"])
    assert 0.7 <= estimated / out["measured_rise"] <= 1.3, (estimated, out["measured_rise"])
    if not freeze:
        without_tower = estimated - out["rows"]["vision tower saved, 1024 patches"]
        assert without_tower / out["measured_rise"] < 0.6


@pytest.mark.parametrize("preset", ["qwen2-vl-tiny", "qwen3-vl-tiny"])
def test_a_frozen_tower_under_checkpointing_keeps_nothing_and_trains_the_same(preset):
    """engines/parallel/fsdp.py: frozen blocks are not checkpointed and the patch embedding's
    output no longer requires grad (transformers' hook for reentrant checkpoints): the tower keeps
    only its mergers' tensors, as without checkpointing, and every gradient is the same."""
    grads, saved = [], []
    for checkpointing in (False, True):
        engine = FSDPEngine(ModelConfig(preset=preset, freeze_vision=True),
                            EngineConfig(gradient_checkpointing=checkpointing), OptimConfig(lr=1e-3)).initialize()
        saved.append(measured_tower_saved(engine)[0])
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
    assert saved[0] == saved[1]
    assert grads[0].keys() == grads[1].keys() and any("merger" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7)
