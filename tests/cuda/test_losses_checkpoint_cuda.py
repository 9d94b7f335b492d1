"""Losses and checkpoints on a GPU: same loss values as on the CPU, exact checkpoint round trip.

The round trip expects bit-identical training after a restore, so it runs with deterministic
algorithms (torch.use_deterministic_algorithms; cuBLAS workspace set in conftest.py) and eager
attention (SDPA's fused backward kernels are not deterministic)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.loss_cases import loss_inputs_from_sequences  # noqa: E402
from polyfsdp.engines.losses import AGG_MODES, PPOLoss  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 4]
    masks = [(torch.rand(n, generator=g) > 0.3).float() for n in lengths]
    per_seq = lambda scale: [torch.randn(n, generator=g) * scale for n in lengths]  # noqa: E731
    inputs = loss_inputs_from_sequences(per_seq(1.0), {"response_mask": masks, "old_log_probs": per_seq(1.0),
                                                       "advantages": per_seq(1.0), "ref_log_probs": per_seq(1.0)},
                                        entropy=[t.abs() for t in per_seq(1.0)])
    inputs.log_probs = inputs.log_probs.to(device)
    inputs.entropy = inputs.entropy.to(device)
    inputs.offsets = inputs.offsets.to(device)
    inputs.fields = {k: v.to(device) for k, v in inputs.fields.items()}
    return inputs


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_ppo_loss_on_gpu_matches_cpu(agg_mode):
    loss_fn = PPOLoss(dual_clip_c=3.0, kl_coef=0.1, entropy_coef=0.01, agg_mode=agg_mode)
    cpu_loss, cpu_metrics = loss_fn(_inputs("cpu"))
    gpu_loss, gpu_metrics = loss_fn(_inputs("cuda"))
    assert gpu_loss.device.type == "cuda"
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss, atol=1e-6, rtol=1e-6)
    assert gpu_metrics.keys() == cpu_metrics.keys()
    for key in cpu_metrics:
        assert float(gpu_metrics[key]) == pytest.approx(float(cpu_metrics[key]), abs=1e-6), key


def test_non_finite_advantage_on_gpu_names_the_index():
    # Values are checked once per batch at the engine's edge (engines/batch/checks.py).
    from polyfsdp.engines.batch.checks import BatchChecks

    inputs = _inputs("cuda")
    inputs.fields["advantages"][6] = float("nan")
    checks = BatchChecks()
    checks.finite("advantages", inputs.fields["advantages"], inputs.offsets)
    with pytest.raises(ValueError, match=r"'advantages' must be finite.*flat index 6 \(sequence 2, position 0\)"):
        checks.read()


@pytest.fixture
def deterministic_algorithms():
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def test_fsdp2_checkpoint_round_trip_on_gpu_restores_params_and_gpu_rng(tmp_path, deterministic_algorithms):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    from polyfsdp.backends import get_backend, init_distributed
    from polyfsdp.engines import checkpoint as ckpt

    backend = get_backend("cuda")
    mesh = init_distributed(backend)

    def build(seed):
        torch.manual_seed(seed)
        cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(backend.device(0))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, seed):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed)).to(backend.device(0))
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()

    def params(model):
        return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}

    model, opt = build(0)
    step(model, opt, 1)
    saved = params(model)
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, backend=backend)
    gpu_draw, py_draw = torch.rand(4, device="cuda").cpu(), random.random()
    step(model, opt, 2)
    after = params(model)

    other, other_opt = build(1)
    assert ckpt.load_checkpoint(tmp_path, model=other, optimizer=other_opt, backend=backend) == (1, None)
    for name, value in params(other).items():
        assert torch.equal(value, saved[name]), name
    assert torch.equal(torch.rand(4, device="cuda").cpu(), gpu_draw) and random.random() == py_draw
    step(other, other_opt, 2)
    for name, value in params(other).items():
        assert torch.equal(value, after[name]), name
