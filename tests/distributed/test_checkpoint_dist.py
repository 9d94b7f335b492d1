"""Sharded checkpoints with two gloo ranks: each rank writes its shard, and everything comes back."""
import os

import torch
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

from polyfsdp.backends import get_backend, init_distributed
from polyfsdp.engines import checkpoint as ckpt

from torchrun_launcher import run_torchrun

HERE = os.path.dirname(__file__)
CHECKS = "step_extra=True params=True optim_shard=True rng=True continue=True final=True"


def test_two_rank_save_load_restores_every_shard_export_matches_and_reshards_to_one(tmp_path):
    result = run_torchrun(os.path.join(HERE, "worker_checkpoint.py"), nproc=2, args=(str(tmp_path),))
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"result_rank{rank}.txt").read_text() == CHECKS, f"rank {rank}"

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

    # Resharding: the 2-rank checkpoint loads into a single-process model.
    mesh = init_distributed(get_backend("cpu"))
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert ckpt.load_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)[0] == 2
    saved = torch.load(tmp_path / "saved_params.pt")
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), saved[name]), name
