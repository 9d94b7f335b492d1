"""FSDPEngine at world size 2 (gloo, torchrun) equals world size 1.

infer_batch: the same log-probs/entropy as one process (max abs diff <= 1e-6; both shard
nothing numerically, only the all-gather differs). train_batch with each rank holding its
share of the batch (alternating sequences; or one rank holding a single short sequence, so
under a token budget it runs placeholder micro-batches to match its peer's count): the same
parameters as one process on the whole batch and as a plain HF reference step, element-wise
within the AdamW first-step bound for a 1e-7 gradient error
(engine_reference.adam_first_step_tolerance)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cpu"))
from engine_cases import (DIST_CASES, LENGTHS, LR, PRESET, engine_config, optim_config, masks_for,  # noqa: E402
                          reference_sft_step, train_loss)
from engine_reference import (assert_params_close_after_adam_step, full_state_dict, left_right_batch,  # noqa: E402
                              no_padding_batch, sequences)
from torchrun_launcher import run_torchrun  # noqa: E402

from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_world2")
    result = run_torchrun(os.path.join(HERE, "worker_engine_fsdp2.py"), nproc=2, args=(str(out),))
    # The root cause sits in the ranks' own tracebacks, before torchrun's summary.
    causes = [line for line in result.stderr.splitlines() if "Error" in line or "error" in line][:20]
    assert result.returncode == 0, "\n".join(causes) + "\n" + result.stderr[-3000:]
    return torch.load(out / "world2.pt")


@pytest.mark.parametrize("name,rmpad,fused,pad_mode,budget,how", DIST_CASES, ids=[c[0] for c in DIST_CASES])
def test_two_process_fsdp_matches_one_process(world2, name, rmpad, fused, pad_mode, budget, how):
    seqs = sequences(LENGTHS, seed=21)
    masks = masks_for(seqs)
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5),
                        engine_config(use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode,
                                      max_tokens_per_micro_batch=budget), optim_config()).initialize()
    initial = full_state_dict(engine.module)
    build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
    out = engine.infer_batch(build(seqs), temperature=torch.linspace(0.6, 1.4, len(seqs)))
    for key in ("log_probs", "entropy"):
        one = out[key].values() if out[key].is_nested else out[key]
        assert one.shape == world2[f"infer_{name}"][key].shape
        assert (one - world2[f"infer_{name}"][key]).abs().max() <= 1e-6

    metrics = engine.train_batch(build(seqs, per_token={"response_mask": masks}), train_loss())
    two = world2[f"train_metrics_{name}"]
    assert abs(metrics["loss"] - two["loss"]) <= 1e-6 * abs(metrics["loss"])
    assert abs(metrics["grad_norm"] - two["grad_norm"]) <= 1e-5 * metrics["grad_norm"]
    _, grads, ref_loss, _ = reference_sft_step(initial, seqs, masks)
    assert abs(two["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_params_close_after_adam_step(world2[f"train_params_{name}"], full_state_dict(engine.module),
                                        grads, LR, 1e-7)
