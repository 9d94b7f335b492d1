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


# ----------------------------------------------------------------------------- polyfsdp-eval


def _model_dir(path, damaged: bool = False):
    """A tiny checkpoint with the character tokenizer; ``damaged``: its weights file cut short,
    so loading it fails (a check that comes first never gets there)."""
    from polyfsdp.trainer.data.tokenizers import CharTokenizer
    from tests.helpers.vllm_cases import write_checkpoint

    write_checkpoint(path, "qwen2-tiny", CharTokenizer())
    CharTokenizer().save_pretrained(str(path))
    if damaged:
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:64])
    return path


def test_the_evaluation_checks_the_threads_and_its_own_kv_cache_not_trainings():
    from polyfsdp.trainer.config.machine_fit import check_eval_fits

    with pytest.raises(ConfigError, match=rf"^trainer.cpu_threads: expected at most {_cpus()} \(the CPUs"):
        check_eval_fits(load_config([f"trainer.cpu_threads={_cpus() + 1}"]), world_size=1)
    # One prompt's 256 samples of up to 2^20 tokens: ~64 GiB of cache for the default model (2 layers,
    # 16-wide keys and values in float32); qwen2-small's 4 layers and 64-wide ones make it ~512 GiB.
    with pytest.raises(ConfigError, match=r"^eval.n_samples=256: a rank's 256 completions of up to 1048576 tokens "
                                          r"need at least .* GiB of KV cache, more than the .* GiB this machine has "
                                          r"per process; lower it or algo.actor.max_new_tokens$"):
        check_eval_fits(load_config([SMALL, "eval.n_samples=256", "eval.temperature=1",
                                     "algo.actor.max_new_tokens=1048576"]), world_size=1)
    check_eval_fits(load_config([]), world_size=1)
    # What training alone needs is not evaluation's concern.
    check_eval_fits(load_config([SMALL, "trainer.sft_batch_size=1048576", "trainer.prompts_per_step=1000000"]), 1)


def test_polyfsdp_eval_says_it_in_one_line_before_loading_the_model(tmp_path):
    model = _model_dir(tmp_path / "model", damaged=True)
    command = [sys.executable, "-m", "polyfsdp.trainer.eval_cli", str(model), "--json", str(tmp_path / "r.json")]
    proc = subprocess.run([*command, f"trainer.cpu_threads={_cpus() + 1}"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"polyfsdp-eval: error: trainer.cpu_threads: expected at most {_cpus()} (the CPUs this process may run on), " \
        f"got {_cpus() + 1}", proc.stderr[-2000:]
    # Control: with the threads it has, the damaged weights are what it reports (the load came next).
    proc = subprocess.run([*command, f"trainer.cpu_threads={_cpus()}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "model.safetensors" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not (tmp_path / "r.json").exists()
