"""Two ranks under torchrun: a reward that hangs on rank 1 and a rank 1 that is killed both
end the run with one polyfsdp line naming rank 1, instead of rank 0 waiting for the
process-group timeout (600 s by default) and a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torchrun_launcher import free_port

OVERRIDES = ["algo=sft", "trainer.sft_steps=1", "trainer.sft_batch_size=8", "data.eval_size=8", "trainer.progress=off",
             "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0"]

REWARDS = """
import os
import signal


def spin(data_source, solution_str, ground_truth, extra_info=None):
    while os.environ["RANK"] == "1":
        pass
    return 0.0


def die(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return 0.0
"""


@pytest.mark.parametrize("fn,expected", [
    ("spin", "polyfsdp-train: error: rank 1: reward.fn={path}:spin took longer than reward.timeout_s=2 s (record "),
    ("die", "polyfsdp-train: error: lost rank 1 (pid "),
])
def test_a_failing_rank_is_named_in_one_line(tmp_path, fn, expected):
    (tmp_path / "rewards.py").write_text(REWARDS)
    env = {**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "polyfsdp.trainer.train", *OVERRIDES,
               f"reward.fn={tmp_path / 'rewards.py'}:{fn}", "reward.timeout_s=2", f"trainer.output_dir={tmp_path / 'o'}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("polyfsdp-train")]
    assert len(ours) == 1 and ours[0].startswith(expected.format(path=tmp_path / "rewards.py")), proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
