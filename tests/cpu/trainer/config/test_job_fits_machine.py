"""A job this machine cannot hold is one line before any work (issue 38, item 8): more CPU threads
than CPUs (4096 threads failed to start: "Resource temporarily unavailable"), and a rollout whose
KV cache alone exceeds the memory (prompts_per_step=1000000 died in the allocator)."""
import os
import subprocess
import sys

import pytest

from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.machine_fit import check_fits
from polyfsdp.trainer.errors import ConfigError


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def test_more_cpu_threads_than_cpus_is_one_config_error():
    with pytest.raises(ConfigError, match=rf"^trainer.cpu_threads: expected at most {_cpus()} \(the CPUs"):
        check_fits(load_config([f"trainer.cpu_threads={_cpus() + 1}"]), world_size=1)
    check_fits(load_config([f"trainer.cpu_threads={_cpus()}"]), world_size=1)  # every CPU is fine


def test_a_rollout_whose_kv_cache_exceeds_the_memory_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^trainer.prompts_per_step=1000000 x algo.actor.group_size=8: .* GiB of "
                                          r"KV cache, more than the .* GiB this machine has per process"):
        check_fits(load_config(["trainer.prompts_per_step=1000000"]), world_size=1)
    check_fits(load_config([]), world_size=1)  # the default job fits
    check_fits(load_config(["trainer.prompts_per_step=1000000", "trainer.rl_steps=0"]), world_size=1)  # no rollout


def test_the_command_line_says_it_in_one_line_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", "trainer.prompts_per_step=1000000",
                           f"trainer.output_dir={out}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("polyfsdp-train: error: trainer.prompts_per_step=1000000")
    assert not out.exists()  # nothing was written


# qwen2-small (hidden 256, 4 layers): 2^20 sequences of 2 tokens save ~180 GiB of activations in
# float32, more than any one process here has; the default model's ~36 GiB may fit a large host.
SMALL = "model.preset=qwen2-small"


def test_an_sft_step_whose_saved_activations_exceed_the_memory_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^trainer.sft_batch_size=1048576: a rank's 1048576 sequences of at least 2 "
                                          r"tokens each, in one micro-batch \(engine.max_tokens_per_micro_batch=null\), "
                                          r"need at least .* GiB of saved activations to train, more than the .* GiB "
                                          r"this machine has per process"):
        check_fits(load_config([SMALL, "trainer.sft_batch_size=1048576"]), world_size=1)
    with pytest.raises(ConfigError, match=r"^trainer.sft_batch_size=1048576: .* GiB of saved activations"):
        check_fits(load_config([SMALL, "algo=sft", "trainer.sft_batch_size=1048576"]), world_size=1)
    check_fits(load_config([SMALL]), world_size=1)  # the default batch fits
    # A capped micro-batch accumulates gradients: only the cap is held at once.
    check_fits(load_config([SMALL, "trainer.sft_batch_size=1048576", "engine.max_tokens_per_micro_batch=4096"]),
               world_size=1)
    check_fits(load_config([SMALL, "trainer.sft_batch_size=1048576", "trainer.sft_steps=0"]), world_size=1)  # no SFT


def test_the_command_line_refuses_an_sft_batch_too_large_in_one_line_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", SMALL, "trainer.sft_batch_size=1048576",
                           f"trainer.output_dir={out}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("polyfsdp-train: error: trainer.sft_batch_size=1048576: ")
    assert not out.exists()  # nothing was written
