"""rollout.engine=vllm, and vllm_server with 2 servers, on 2 gloo ranks (torchrun) with a sharded
FSDP2 policy: on every rank vLLM's greedy completions equal our decoding loop's, before and
after an optimizer step (the sync gathers every shard; check_sync holds vLLM to the policy at
1e-5)."""
import os

import pytest
import torch

from torchrun_launcher import run_and_load  # noqa: E402
from tests.helpers.vllm_cases import require_vllm  # noqa: E402

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("engine", [(), ("vllm_server", "2")], ids=["vllm", "vllm_server"])
def test_vllm_on_two_ranks_follows_the_sharded_policy(tmp_path, engine):
    require_vllm()
    run_and_load(os.path.join(HERE, "worker_vllm.py"), tmp_path, 2, engine, "rank0.pt")
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        assert seen["sharded"]
        for stage in ("before", "after"):
            theirs, ours = seen[stage]
            assert theirs == ours, (rank, stage)
        assert seen["before"][1] != seen["after"][1]  # the step changed what the policy writes
        assert seen["weight_version"] == 2 and seen["sync_error"] < 1e-5
