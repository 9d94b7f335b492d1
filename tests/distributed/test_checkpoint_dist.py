"""Sharded checkpoints with two gloo ranks: each rank writes its shard, and everything comes back."""
import os

import torch
from transformers import AutoModelForCausalLM

from torchrun_launcher import run_torchrun

HERE = os.path.dirname(__file__)
CHECKS = "step_extra=True params=True optim_shard=True rng=True continue=True final=True"


def test_two_rank_save_load_restores_every_shard_and_export_matches_logits(tmp_path):
    result = run_torchrun(os.path.join(HERE, "worker_checkpoint.py"), nproc=2, args=(str(tmp_path),))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank="))
    assert lines == [f"rank=0 {CHECKS}", f"rank=1 {CHECKS}"]

    step_dir = tmp_path / "ckpt" / "step_000002"
    names = sorted(p.name for p in step_dir.iterdir())
    # One shard file and one RNG file per rank.
    assert [n for n in names if n.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    assert {"rng_rank0.pt", "rng_rank1.pt", "trainer_state.pt", ".metadata"} <= set(names)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000002"

    expected = torch.load(tmp_path / "logits.pt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = loaded(expected["input_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-6, rtol=0)
