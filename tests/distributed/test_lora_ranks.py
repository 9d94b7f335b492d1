"""LoRA under FSDP2 on 2 gloo ranks (torchrun) equals 1 rank: each rank trains on its share of
every batch, and after each step the adapters equal a one-process engine's on the whole batch
(1e-5) while the base stays untouched; the 2-rank checkpoint holds only adapters (plus AdamW
state) and resumes in a one-rank engine to the same next step."""
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers.engine_reference import full_state_dict  # noqa: E402
from torchrun_launcher import run_and_load  # noqa: E402

pytest.importorskip("peft", reason="LoRA tests need peft (pip install -e '.[lora]')")
from tests.helpers.lora_cases import STEPS, lora_engine, step_batch  # noqa: E402

from polyfsdp.engines.losses import SFTLoss  # noqa: E402

HERE = os.path.dirname(__file__)
TOL = 1e-5


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_world2")
    return out, run_and_load(os.path.join(HERE, "worker_lora.py"), out, 2, (), "world2.pt")


def _adapters(engine):
    return {k: v for k, v in full_state_dict(engine.module).items() if ".lora_" in k}


def _assert_close(actual, expected, tol):
    assert actual.keys() == expected.keys() and actual
    for key, value in expected.items():
        diff = (actual[key] - value).abs().max().item()
        assert diff <= tol, (key, diff)


def test_two_rank_lora_steps_equal_one_rank(world2):
    _, two = world2
    one = lora_engine()
    initial = full_state_dict(one.module)
    # Both worlds start from the same model: base from the seed, adapters drawn whole.
    _assert_close(two["initial"], initial, 0.0)
    for step in range(STEPS):
        metrics = one.train_batch(step_batch(step), SFTLoss())
        assert metrics["loss"] == pytest.approx(two["metrics"][step]["loss"], rel=TOL)
        assert metrics["grad_norm"] == pytest.approx(two["metrics"][step]["grad_norm"], rel=TOL)
        _assert_close(two["trained"][step], _adapters(one), TOL)
    # Negative control: the adapters moved by far more than the tolerance, the base not at all.
    trained = full_state_dict(one.module)
    assert max((trained[k] - initial[k]).abs().max().item() for k in two["trained"][-1]) > 100 * TOL
    assert all(torch.equal(trained[k], v) for k, v in initial.items() if ".lora_" not in k)


def test_two_rank_checkpoint_holds_only_adapters_and_resumes_on_one_rank(world2):
    out, two = world2
    keys = set(FileSystemReader(str(out / "ckpt" / "step_000001")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    adapter_keys = {f"model.{k}" for k in two["trained"][0]}
    assert model_keys == adapter_keys, sorted(model_keys ^ adapter_keys)[:5]
    assert any(k.startswith("optim.state.") for k in keys)
    resumed = lora_engine(seed=3)
    assert resumed.load_checkpoint(out / "ckpt")[0] == 1
    _assert_close(_adapters(resumed), two["trained"][0], 0.0)
    resumed.train_batch(step_batch(1), SFTLoss())
    _assert_close(_adapters(resumed), two["trained"][1], TOL)
