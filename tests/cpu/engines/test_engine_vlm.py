"""Vision-language models in the engine (docs/vision-language.md): tiny random Qwen2-VL,
Qwen2.5-VL and Qwen3-VL built from configs; batches with 0, 1 and 2 images per sequence and
text-only rows. Every mode equals Hugging Face's own forward of each sequence alone (eager
attention, its own mrope positions) to 1e-5 in fp32; micro-batches, gradients, the frozen
tower, the FSDP2-sharded tower, packed-boundary positions and malformed inputs."""
from dataclasses import replace

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.helpers.engine_reference import built_once_per_key, full_state_dict, jagged_of
from polyfsdp.backends.base import HOST_CU_SEQ_LENS
from polyfsdp.engines.batch.flat import batch_to_flat
from polyfsdp.engines.batch.images import mrope_positions
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.head.forward import PackedRowInputs
from polyfsdp.engines.losses import SFTLoss
from polyfsdp.engines.presets import VLM_TOKENS
from tests.helpers.vlm_reference import (IMAGE, MERGE, VLM_PRESETS, vlm_batch, vlm_reference_logprobs, vlm_reference_model,
                           vlm_sequences)

TOL = 1e-5
# 1, 0, 2, 1, 0 and 2 images: text-only rows between image rows, grids with h != w.
SPEC = [["small"], [], ["wide", "square"], ["square"], [], ["small", "small"]]
TEMPS = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 0.9])
MODES = [(rm, fu) for rm in (True, False) for fu in (True, False)]
MODE_IDS = [f"rmpad{int(a)}-fused{int(b)}" for a, b in MODES]
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", HOST_CU_SEQ_LENS)


class Family:
    """One engine per preset (modes flipped per call), its reference and expected outputs."""

    def __init__(self, preset, **model):
        self.engine = FSDPEngine(ModelConfig(preset=preset, seed=3, **model), EngineConfig(),
                                 OptimConfig(lr=1e-2)).initialize()
        self.reference = vlm_reference_model(preset, full_state_dict(self.engine.module))
        self.seqs = vlm_sequences(SPEC, seed=5)
        with torch.no_grad():
            self.expected = vlm_reference_logprobs(self.reference, self.seqs, TEMPS.tolist())

    def run(self, pad_mode, rmpad, fused, **config):
        self.engine.engine_config = replace(self.engine.engine_config, use_remove_padding=rmpad,
                                            use_fused_kernels=fused, pad_mode=pad_mode, **config)
        batch = vlm_batch(self.seqs, pad_mode)
        return batch, self.engine.infer_batch(batch, temperature=TEMPS)


@pytest.fixture(scope="module")
def family():
    yield from built_once_per_key(Family)


def _flat(out, batch, pad_mode):
    if pad_mode == "no_padding":
        assert torch.equal(out.offsets(), batch["input_ids"].offsets())
        return out.values()
    mask = batch["attention_mask"].bool()
    assert torch.all(out[~mask] == 0), "padding positions must be zero"
    return out[mask]


def _assert_matches(out, batch, pad_mode, expected, tol=TOL):
    for key, exp in zip(("log_probs", "entropy"), expected):
        got = _flat(out[key], batch, pad_mode)
        assert got.dtype == torch.float32
        diff = (got.double() - torch.cat(exp)).abs().max().item()
        assert diff <= tol, (key, diff)


@pytest.mark.parametrize("preset", VLM_PRESETS)
@pytest.mark.parametrize("pad_mode", ["no_padding", "left_right"])
@pytest.mark.parametrize("rmpad,fused", MODES, ids=MODE_IDS)
def test_infer_batch_matches_hf_per_sequence_in_every_mode(family, preset, pad_mode, rmpad, fused):
    fam = family(preset)
    batch, out = fam.run(pad_mode, rmpad, fused)
    _assert_matches(out, batch, pad_mode, fam.expected)


@pytest.mark.parametrize("rmpad,fused", MODES, ids=MODE_IDS)
def test_micro_batches_take_whole_sequences_with_their_images(family, rmpad, fused):
    fam = family("qwen2.5-vl-tiny")
    batch, whole = fam.run("no_padding", rmpad, fused, max_tokens_per_micro_batch=None)
    # A budget below most sequences: several micro-batches, some text-only, some with two images.
    _, split = fam.run("no_padding", rmpad, fused, max_tokens_per_micro_batch=12)
    fam.engine.engine_config = replace(fam.engine.engine_config, max_tokens_per_micro_batch=None)
    for key in ("log_probs", "entropy"):
        # The tower sees other images beside each one: fp32 summation order (entropies near 4.8).
        assert (split[key].values() - whole[key].values()).abs().max() <= TOL
    _assert_matches(split, batch, "no_padding", fam.expected)


def test_text_only_batch_without_image_fields(family):
    fam = family("qwen2-vl-tiny")
    text = [i for i, images in enumerate(SPEC) if not images]
    seqs = [fam.seqs[i] for i in text]
    batch = vlm_batch(seqs, "no_padding")
    del batch["pixel_values"], batch["image_grid_thw"]
    with torch.no_grad():
        expected = vlm_reference_logprobs(fam.reference, seqs, [1.0] * len(seqs))
    for rmpad, fused in MODES:
        fam.engine.engine_config = replace(fam.engine.engine_config, use_remove_padding=rmpad,
                                           use_fused_kernels=fused, pad_mode="no_padding")
        _assert_matches(fam.engine.infer_batch(batch), batch, "no_padding", expected)


def _response_masks(seqs):
    masks = []
    for seq in seqs:
        m = torch.zeros(len(seq["ids"]))
        m[len(seq["ids"]) // 2: -1] = 1.0  # the second half, image tokens included where they fall
        masks.append(m)
    return masks


def _grads(module):
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().clone()
    return out


@pytest.mark.parametrize("preset", ["qwen2-vl-tiny", "qwen2.5-vl-tiny"])
def test_gradients_agree_across_all_modes_and_the_reference(family, preset):
    fam = family(preset)
    engine, seqs, masks = fam.engine, fam.seqs, _response_masks(fam.seqs)
    ref = fam.reference
    ref.zero_grad(set_to_none=True)
    lps, _ = vlm_reference_logprobs(ref, seqs, [1.0] * len(seqs))
    sum(lp.dot(m.double()) for lp, m in zip(lps, masks)).backward()
    expected = _grads(ref)
    ref.zero_grad(set_to_none=True)
    assert any(name.startswith("model.visual.blocks") for name in expected), "the tower must get gradients"
    scale = max(g.abs().max().item() for g in expected.values())
    for pad_mode in ("no_padding", "left_right"):
        batch = vlm_batch(seqs, pad_mode, per_token={"response_mask": masks})
        for rmpad, fused in MODES:
            engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, use_fused_kernels=fused,
                                           pad_mode=pad_mode)
            flat = batch_to_flat(batch, pad_mode)
            with engine.train_mode():
                log_probs, _ = engine.forward_flat(flat, return_entropy=False)
                (log_probs * flat.fields["response_mask"]).sum().backward()
            grads = _grads(engine.module)
            engine.optimizer.zero_grad(set_to_none=True)
            assert grads.keys() == expected.keys()
            for name, g in grads.items():
                diff = (g.double() - expected[name].double()).abs().max().item()
                assert diff <= 1e-5 * scale, (pad_mode, rmpad, fused, name, diff, scale)


def test_frozen_tower_gets_no_gradients_and_no_updates_while_its_merger_trains():
    fam = Family("qwen2-vl-tiny", freeze_vision=True)
    engine = fam.engine
    before = full_state_dict(engine.module)
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    masks = _response_masks(fam.seqs)
    engine.engine_config = replace(engine.engine_config, use_fused_kernels=True)
    engine.forward_backward(vlm_batch(fam.seqs, "no_padding", per_token={"response_mask": masks}), SFTLoss())
    tower = {name: p for name, p in engine.module.named_parameters() if name.startswith("model.visual.")}
    frozen = {name: p for name, p in tower.items() if "merger" not in name}
    assert frozen and all(p.grad is None and not p.requires_grad and id(p) not in trained for p in frozen.values())
    assert all(p.grad is not None and id(p) in trained for name, p in tower.items() if name not in frozen)
    engine.optimizer_step()
    after = full_state_dict(engine.module)
    assert all(torch.equal(before[name], after[name]) for name in frozen)
    assert any(not torch.equal(before[name], after[name]) for name in tower if name not in frozen)


def test_freeze_vision_on_a_text_model_is_one_clear_line():
    with pytest.raises(ValueError, match=r"^ModelConfig\.freeze_vision: .* has no vision tower"):
        FSDPEngine(ModelConfig(preset="qwen2-tiny", freeze_vision=True), EngineConfig()).initialize()


@pytest.mark.parametrize("preset", ["qwen2-vl-tiny", "qwen3-vl-tiny"])
def test_tower_is_sharded_with_the_decoder_and_text_only_micro_batches_still_run_it(preset):
    """FSDP2 on one rank: the tower's blocks, mergers and the tower are units of their own; a
    text-only micro-batch runs the tower on a dummy image (its peers' collectives would wait
    for it), times zero: the numbers and the gradients stay the reference's."""
    engine = FSDPEngine(ModelConfig(preset=preset, seed=3), EngineConfig(shard_single_rank=True),
                        OptimConfig()).initialize()
    tower = engine.module.model.visual
    assert isinstance(tower, FSDPModule) and all(isinstance(b, FSDPModule) for b in tower.blocks)
    assert isinstance(tower.merger, FSDPModule)
    seqs = vlm_sequences(SPEC, seed=5)
    ref = vlm_reference_model(preset, full_state_dict(engine.module))
    with torch.no_grad():
        expected = vlm_reference_logprobs(ref, seqs, TEMPS.tolist())
    calls = []
    handle = tower.register_forward_hook(lambda *args: calls.append(1))
    for rmpad in (True, False):
        engine.engine_config = replace(engine.engine_config, use_remove_padding=rmpad, max_tokens_per_micro_batch=8)
        batch = vlm_batch(seqs, "no_padding")
        _assert_matches(engine.infer_batch(batch, temperature=TEMPS), batch, "no_padding", expected)
    handle.remove()
    assert len(calls) == 2 * len(SPEC), "the tower runs once per micro-batch, text-only ones included"
    masks = _response_masks(seqs)
    engine.forward_backward(vlm_batch(seqs, "no_padding", per_token={"response_mask": masks}), SFTLoss())
    assert all(p.grad is not None for p in tower.parameters())


def test_mrope_positions_restart_at_each_packed_boundary(family):
    """Each sequence's three position rows are the model's own for that sequence alone."""
    fam = family("qwen2-vl-tiny")
    body = fam.engine.module.model
    flat = batch_to_flat(vlm_batch(fam.seqs, "no_padding"), "no_padding")
    got = mrope_positions(body.get_rope_index, IMAGE, MERGE, flat.input_ids, flat.seq_lens, flat.images)
    for seq, positions in zip(fam.seqs, got):
        alone, _ = body.get_rope_index(seq["ids"][None], mm_token_type_ids=(seq["ids"] == IMAGE).int()[None],
                                       image_grid_thw=seq["grids"] if len(seq["grids"]) else None)
        assert positions[:, 0].tolist() == [0, 0, 0] and torch.equal(positions, alone[:, 0])


def _packed_inputs_as(monkeypatch, crossing: bool):
    """The packed row without the explicit boundaries (cu_seq_lens and the host copy), so that
    attention must find the sequences from the positions transformers hands it (row 0 of
    the four); ``crossing``: row 0 runs on across boundaries, as positions computed over the
    whole packed row would."""
    original = PackedRowInputs.model_inputs

    def model_inputs(self, flat):
        inputs = {k: v for k, v in original(self, flat).items() if k not in BOUNDARY_KEYS}
        if crossing:
            positions = inputs["position_ids"].clone()
            positions[0, 0] = torch.arange(flat.total)
            inputs["position_ids"] = positions
        return inputs

    monkeypatch.setattr(PackedRowInputs, "model_inputs", model_inputs)


@pytest.mark.parametrize("crossing", [False, True], ids=["restarting", "crossing-negative-control"])
def test_attention_keeps_packed_sequences_apart_by_the_text_position_row(family, monkeypatch, crossing):
    """RoPE only sees position differences, so a constant offset per sequence changes nothing;
    what must restart at every packed boundary is the text row that transformers passes to
    attention as ``position_ids`` (Qwen2-VL's four-row positions: text row, then t, h, w)."""
    fam = family("qwen2-vl-tiny")
    _packed_inputs_as(monkeypatch, crossing)
    batch, out = fam.run("no_padding", True, False)
    diff = (out["log_probs"].values().double() - torch.cat(fam.expected[0])).abs().max().item()
    assert (diff > 100 * TOL) if crossing else (diff <= TOL), diff


def _malformed(seqs, **replace_fields):
    batch = vlm_batch(seqs, "no_padding")
    for name, value in replace_fields.items():
        batch[name] = value
    return batch


def test_malformed_images_are_one_line_naming_the_sequence(family):
    fam = family("qwen2-vl-tiny")
    engine, seqs = fam.engine, fam.seqs
    engine.engine_config = replace(engine.engine_config, use_remove_padding=True, pad_mode="no_padding")
    # Sequence 2's second image says 2x4 patches where its tokens and pixels are 4x4.
    grids = [s["grids"].clone() for s in seqs]
    grids[2][1] = torch.tensor([1, 2, 4])
    pixels = [s["pixels"] for s in seqs]
    pixels[2] = pixels[2][:8 + 8]
    cases = [
        (dict(image_grid_thw=jagged_of(grids), pixel_values=jagged_of(pixels)),
         r"^sequence 2: its image tokens form runs of \[2, 4\] tokens, its image_grid_thw gives \[2, 2\]"),
        (dict(image_grid_thw=jagged_of(grids)), r"^sequence 2: pixel_values has 24 patch rows, its image_grid_thw "
                                                r"\[\[1, 2, 4\], \[1, 2, 4\]\] needs 16"),
        # An image given to a text-only sequence (1), no image tokens there.
        (dict(image_grid_thw=jagged_of([grids[0], grids[0], *grids[2:]]),
              pixel_values=jagged_of([pixels[0], pixels[0], *pixels[2:]])),
         r"^sequence 1: its image tokens form runs of \[\] tokens, its image_grid_thw gives \[1\]"),
    ]
    # A video token in sequence 4 (text-only): videos would run as text, so they are refused.
    video = [s["ids"].clone() for s in seqs]
    video[4][1] = VLM_TOKENS["video_token_id"]
    cases.append((dict(input_ids=jagged_of(video)), r"^sequence 4: holds video tokens \(id 127\); videos are "
                                                    r"not supported yet"))
    for fields, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            engine.infer_batch(_malformed(seqs, **fields))
        assert "\n" not in str(caught.value)
    batch = vlm_batch(seqs, "no_padding")
    del batch["image_grid_thw"]
    with pytest.raises(ValueError, match=r"^batch\['pixel_values'\] comes without batch\['image_grid_thw'\]"):
        engine.infer_batch(batch)
    batch = vlm_batch(seqs, "no_padding")
    batch["image_grid_thw"] = torch.ones(len(seqs), 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^batch\['image_grid_thw'\]: expected a jagged nested tensor"):
        engine.infer_batch(batch)


def test_sequence_parallelism_refuses_a_vision_language_model_in_one_line(family):
    from types import SimpleNamespace

    from polyfsdp.engines.parallel.sequence import setup_sequence_parallel

    with pytest.raises(ValueError, match=r"^ulysses_sp_size=2: sequence parallelism does not support "
                                         r"vision-language models yet \(Qwen2VLForConditionalGeneration\)"):
        setup_sequence_parallel(family("qwen2-vl-tiny").engine.module, SimpleNamespace(sp_size=2))


def test_export_hf_writes_the_vision_language_model_and_loads_back(family, tmp_path):
    """The export is the image-text-to-text class (tower included); an engine built from the
    directory gives the same log-probs. The processor's files are not written yet."""
    fam = family("qwen3-vl-tiny")
    fam.engine.export_hf(str(tmp_path))
    loaded = FSDPEngine(ModelConfig(path=str(tmp_path)), EngineConfig()).initialize()
    assert type(loaded.module).__name__ == "Qwen3VLForConditionalGeneration"
    batch = vlm_batch(fam.seqs, "no_padding")
    _assert_matches(loaded.infer_batch(batch, temperature=TEMPS), batch, "no_padding", fam.expected)


def test_sharded_checkpoint_round_trip_after_a_step_with_a_frozen_tower(tmp_path):
    """save_checkpoint / load_checkpoint of a VLM trained one step with freeze_vision: the
    loaded engine gives the trained engine's log-probs. The frozen tower is not in the
    checkpoint (like a LoRA run's base, it is rebuilt from the model config: the same seed)."""
    fam = Family("qwen2-vl-tiny", freeze_vision=True)
    batch = vlm_batch(fam.seqs, "no_padding", per_token={"response_mask": _response_masks(fam.seqs)})
    fam.engine.train_batch(batch, SFTLoss())
    fam.engine.save_checkpoint(str(tmp_path))
    trained = fam.engine.infer_batch(batch)
    fresh = FSDPEngine(ModelConfig(preset="qwen2-vl-tiny", seed=3, freeze_vision=True), EngineConfig(),
                       OptimConfig(lr=1e-2)).initialize()
    untrained = fresh.infer_batch(batch)
    assert not torch.equal(untrained["log_probs"].values(), trained["log_probs"].values())
    fresh.load_checkpoint(str(tmp_path))
    again = fresh.infer_batch(batch)
    for key in ("log_probs", "entropy"):
        assert torch.equal(again[key].values(), trained[key].values())


@pytest.mark.parametrize("preset", VLM_PRESETS)
def test_bfloat16_compute_stays_near_the_float32_reference(family, preset):
    """param_dtype=bfloat16 (FSDP2's casts, the tower included): within bf16's rounding of the
    fp32 reference, and the model's output carries no tower views for FSDP2 to warn about."""
    import warnings

    fam = family(preset)
    batch = vlm_batch(fam.seqs, "no_padding", per_token={"response_mask": _response_masks(fam.seqs)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the engine's own filter, added when it builds, comes first
        engine = FSDPEngine(ModelConfig(preset=preset, seed=3), EngineConfig(param_dtype="bfloat16"),
                            OptimConfig()).initialize()
        out = engine.infer_batch(batch, temperature=TEMPS)
        engine.forward_backward(batch, SFTLoss())
    assert not [w for w in caught if "view tensor" in str(w.message)]
    _assert_matches(out, batch, "no_padding", fam.expected, tol=1e-2)


def test_lora_step_then_merged_export_gives_the_same_log_probs(tmp_path):
    """LoRA over every linear (the tower's included): one SFT step changes the log-probs, and
    the merged export, loaded back as a plain model, gives the trained engine's."""
    engine = FSDPEngine(ModelConfig(preset="qwen2-vl-tiny", seed=3, lora={"rank": 4}), EngineConfig(),
                        OptimConfig(lr=1e-2)).initialize()
    seqs = vlm_sequences(SPEC, seed=5)
    batch = vlm_batch(seqs, "no_padding", per_token={"response_mask": _response_masks(seqs)})
    before = engine.infer_batch(batch)
    engine.train_batch(batch, SFTLoss())
    trained = engine.infer_batch(batch)
    assert (trained["log_probs"].values() - before["log_probs"].values()).abs().max() > 1e-4
    engine.export_hf(str(tmp_path))
    merged = FSDPEngine(ModelConfig(path=str(tmp_path)), EngineConfig()).initialize()
    again = merged.infer_batch(batch)
    for key in ("log_probs", "entropy"):
        assert (again[key].values() - trained[key].values()).abs().max() <= TOL


def test_the_docs_example_runs_as_written():
    """docs/vision-language.md's example: one image row and one text row, outputs like input_ids."""
    import re

    from tests.helpers import ROOT

    page = (ROOT / "docs" / "vision-language.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 1
    scope = {}
    exec(blocks[0], scope)
    assert torch.equal(scope["out"]["log_probs"].offsets(), torch.tensor([0, 7, 10]))


def test_freeze_vision_keeps_lora_adapters_on_the_tower_frozen():
    """With LoRA over every linear, the tower's adapters stay frozen (at B = 0) under
    freeze_vision; the merger's and the decoder's adapters train."""
    engine = FSDPEngine(ModelConfig(preset="qwen2-vl-tiny", seed=3, lora={"rank": 4}, freeze_vision=True),
                        EngineConfig(), OptimConfig(lr=1e-2)).initialize()
    seqs = vlm_sequences(SPEC, seed=5)
    engine.forward_backward(vlm_batch(seqs, "no_padding", per_token={"response_mask": _response_masks(seqs)}),
                            SFTLoss())
    adapters = {name: p for name, p in engine.module.named_parameters() if "lora_" in name}
    tower = {name for name in adapters if ".visual." in name and "merger" not in name}
    assert tower and all(adapters[name].grad is None and not adapters[name].requires_grad for name in tower)
    trained = [name for name in adapters if name not in tower]
    assert any("merger" in name for name in trained) and any("language_model" in name for name in trained)
    assert all(adapters[name].grad is not None for name in trained)


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad1", "rmpad0"])
def test_critic_values_equal_the_hf_body_times_the_value_head(rmpad):
    """A critic on a vision-language model: per-token values are HF's body hidden states of
    each sequence alone (its own positions) through the value head, the last position 0."""
    engine = FSDPEngine(ModelConfig(preset="qwen2.5-vl-tiny", seed=3, value_head=True, value_head_init_std=0.5),
                        EngineConfig(use_remove_padding=rmpad)).initialize()
    state = full_state_dict(engine.module)
    weight, bias = state.pop("lm_head.weight"), state.pop("lm_head.bias")
    reference = vlm_reference_model("qwen2.5-vl-tiny", {**state, "lm_head.weight": torch.zeros(128, 32)})
    seqs = vlm_sequences(SPEC, seed=5)
    expected = []
    with torch.no_grad():
        for seq in seqs:
            images = {} if not len(seq["grids"]) else {
                "pixel_values": seq["pixels"], "image_grid_thw": seq["grids"],
                "mm_token_type_ids": (seq["ids"] == IMAGE).int()[None]}
            hidden = reference.model(input_ids=seq["ids"][None], use_cache=False, **images).last_hidden_state[0]
            values = (hidden.double() @ weight.double().T + bias.double())[:, 0]
            values[-1] = 0.0
            expected.append(values)
    got = engine.infer_values(vlm_batch(seqs, "no_padding"))["values"].values()
    assert (got.double() - torch.cat(expected)).abs().max() <= TOL


def test_activation_checkpointing_gives_the_same_gradients():
    """gradient_checkpointing recomputes the tower's blocks and the decoder's layers in the
    backward: the same gradients as without, through the fused head with the loss inside and
    micro-batches."""
    seqs = vlm_sequences(SPEC, seed=5)
    batch = vlm_batch(seqs, "no_padding", per_token={"response_mask": _response_masks(seqs)})
    grads = []
    for checkpointing in (False, True):
        engine = FSDPEngine(ModelConfig(preset="qwen2-vl-tiny", seed=3),
                            EngineConfig(gradient_checkpointing=checkpointing, use_fused_kernels=True,
                                         max_tokens_per_micro_batch=16)).initialize()
        engine.forward_backward(batch, SFTLoss())
        grads.append(_grads(engine.module))
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert (g - grads[1][name]).abs().max() <= 1e-6, name
