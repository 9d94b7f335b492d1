"""engine.offload=optimizer on 2 gloo ranks (the host step forced through a CPU stand-in declared as
an accelerator): the AdamW state is each rank's local shard on the host, three steps equal
offload=none exactly (same losses, gradient norms, parameters), and a checkpoint of the host
state resumes to the same step."""
import os

import torch

from torchrun_launcher import run_and_load

HERE = os.path.dirname(__file__)


def test_two_rank_host_optimizer_equals_device_adamw_and_resumes(tmp_path):
    out = run_and_load(os.path.join(HERE, "worker_offload_optimizer.py"), tmp_path, 2, (), "world2.pt")
    assert out["none_optimizer"] == "AdamW" and out["optimizer_optimizer"] == "HostAdamW"
    assert out["state_is_local_host_shard"]
    for want, got in zip(out["none_metrics"], out["optimizer_metrics"]):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    params, reference = out["optimizer_params"], out["none_params"]
    assert params.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(params[name], value), name
        assert torch.equal(out["resumed_params"][name], value), name
    assert out["resumed_step"] == 2
    # Negative control: the steps moved every tensor they train (no no-op passes as equal).
    assert all(not torch.equal(out["initial"][name], value) for name, value in reference.items())
