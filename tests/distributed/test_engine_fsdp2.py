"""FSDPEngine at world size 2 (torchrun; gloo always, nccl/hccl with two devices) equals world size
1 and an independent plain-HF reference (engine_reference, per sequence, fp32 on the CPU).

infer_batch: the same log-probs/entropy as one process (both shard nothing numerically, only the
all-gather differs) and as the reference. train_batch with each rank holding its share of the
batch (alternating sequences; or one rank holding a single short sequence, so under a token budget
it runs placeholder micro-batches to match its peer's count): the same loss and gradient norm as
the reference step, and the same parameters as one process on the whole batch and as the
reference, element-wise within the AdamW first-step bound for a gradient error of TOLS[...]["grad"]
(engine_reference.adam_first_step_tolerance). Every case, token-budget ones included, is checked
against the reference.

Tolerances: on the CPU, world 2 vs world 1 <= 1e-6 and vs the reference <= 1e-5 (the CPU engine
mode matrix's bound). On an accelerator 10x looser (GPU/NPU kernels reorder sums; the reference
runs on the CPU)."""
import os

import pytest
import torch

from tests.helpers.engine_cases import (DIST_CASES, LENGTHS, LR, PRESET, engine_config, optim_config, masks_for,  # noqa: E402
                          reference_sft_step, train_loss)
from tests.helpers.engine_reference import (assert_params_close_after_adam_step, full_state_dict, left_right_batch,  # noqa: E402
                              no_padding_batch, reference_logprobs, reference_model, sequences)
from torchrun_launcher import run_torchrun  # noqa: E402

from polyfsdp.backends import get_backend  # noqa: E402
from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

HERE = os.path.dirname(__file__)
TOLS = {"cpu": {"one_process": 1e-6, "reference": 1e-5, "grad": 1e-7},
        "accelerator": {"one_process": 1e-5, "reference": 1e-4, "grad": 1e-6}}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, dist_backend):
    out = tmp_path_factory.mktemp(f"engine_world2_{dist_backend}")
    result = run_torchrun(os.path.join(HERE, "worker_engine_fsdp2.py"), nproc=2, args=(str(out),),
                          backend=dist_backend)
    # The root cause sits in the ranks' own tracebacks, before torchrun's summary.
    causes = [line for line in result.stderr.splitlines() if "Error" in line or "error" in line][:20]
    assert result.returncode == 0, "\n".join(causes) + "\n" + result.stderr[-3000:]
    return torch.load(out / "world2.pt", map_location="cpu")


def _on_cpu(state):
    return {k: v.cpu() for k, v in state.items()}


def _real_tokens(values, batch, pad_mode):
    """Flat per-token values of the real tokens (a left_right output keeps only the masked ones)."""
    values = values.cpu()
    return values if pad_mode == "no_padding" else values[batch["attention_mask"].bool()]


@pytest.mark.parametrize("name,rmpad,fused,pad_mode,budget,how", DIST_CASES, ids=[c[0] for c in DIST_CASES])
def test_two_process_fsdp_matches_one_process_and_reference(world2, dist_backend, name, rmpad, fused, pad_mode,
                                                            budget, how):
    tols = TOLS["cpu" if dist_backend == "cpu" else "accelerator"]
    seqs = sequences(LENGTHS, seed=21)
    masks = masks_for(seqs)
    temps = torch.linspace(0.6, 1.4, len(seqs))
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5),
                        engine_config(use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode,
                                      max_tokens_per_micro_batch=budget), optim_config(),
                        backend=get_backend(dist_backend)).initialize()
    initial = _on_cpu(full_state_dict(engine.module))
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    batch = build(seqs)
    out = engine.infer_batch(batch, temperature=temps)
    with torch.no_grad():
        expected = dict(zip(("log_probs", "entropy"),
                            (torch.cat(v) for v in reference_logprobs(reference_model(PRESET, initial), seqs,
                                                                       temps.tolist()))))
    for key in ("log_probs", "entropy"):
        one = (out[key].values() if out[key].is_nested else out[key]).cpu()
        two = world2[f"infer_{name}"][key]
        assert one.shape == two.shape
        assert (one - two).abs().max() <= tols["one_process"], key
        diff = (_real_tokens(two, batch, pad_mode).double() - expected[key]).abs().max().item()
        assert diff <= tols["reference"], (key, diff)

    metrics = engine.train_batch(build(seqs, per_token={"response_mask": masks}), train_loss())
    two = world2[f"train_metrics_{name}"]
    assert abs(metrics["loss"] - two["loss"]) <= 1e-6 * abs(metrics["loss"])
    assert abs(metrics["grad_norm"] - two["grad_norm"]) <= 1e-5 * metrics["grad_norm"]
    ref_params, grads, ref_loss, ref_norm = reference_sft_step(initial, seqs, masks)
    assert abs(two["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)
    assert abs(two["grad_norm"] - ref_norm) <= 1e-4 * ref_norm
    assert_params_close_after_adam_step(world2[f"train_params_{name}"], _on_cpu(full_state_dict(engine.module)),
                                        grads, LR, tols["grad"])
    assert_params_close_after_adam_step(world2[f"train_params_{name}"], ref_params, grads, LR, tols["grad"])
