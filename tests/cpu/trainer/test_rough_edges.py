"""One line, not a traceback, for what a new user runs into: a damaged model.safetensors, an
unknown POLYFSDP_BACKEND, a model directory that asks to run its own code."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.cpu.trainer.test_cli import TINY, _assert_one_line_error
from transformers import AutoModelForCausalLM, Qwen2Config

from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.train import main


def _model_dir(tmp_path):
    tok = CharTokenizer("abcde=")
    config = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    directory = tmp_path / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(str(directory))
    return directory


def _model_dir_quiet(tmp_path, capsys):
    directory = _model_dir(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    return directory


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_safetensors_in_model_path_is_one_line_naming_the_file(tmp_path, capsys, damage):
    directory = _model_dir_quiet(tmp_path, capsys)
    weights = directory / "model.safetensors"
    weights.write_bytes(b"" if damage == "empty" else weights.read_bytes()[: weights.stat().st_size // 2])
    code = main([*TINY, "algo=sft", f"model.path={directory}", f"trainer.output_dir={tmp_path / 'out'}"])
    line = _one_error_line(capsys)
    assert code == 2 and line.startswith("polyfsdp-train: error: model (") and f"{weights}: unreadable safetensors" \
        in line, line


def test_unknown_backend_in_the_environment_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", f"trainer.output_dir={tmp_path / 'x'}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "POLYFSDP_BACKEND": "tpu"})
    _assert_one_line_error(proc, "POLYFSDP_BACKEND: unknown backend 'tpu'; choose one of auto, cpu, cuda, npu")


def test_model_directory_code_never_runs(tmp_path, capsys):
    directory = _model_dir_quiet(tmp_path, capsys)
    marker = tmp_path / "ran"
    (directory / "evil_model.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil_model.EvilConfig", "AutoModelForCausalLM": "evil_model.EvilModel"}
    config["model_type"] = "evil"
    (directory / "config.json").write_text(json.dumps(config))
    code = main([*TINY, "algo=sft", f"model.path={directory}", f"trainer.output_dir={tmp_path / 'out'}"])
    line = _one_error_line(capsys)
    assert code == 2 and "trust_remote_code" in line, line
    assert not marker.exists()


def test_last_line_is_the_result_and_each_models_patch_summary_is_printed_once(tmp_path, capsys):
    code = main([*TINY, "algo.actor.group_size=2", "trainer.sft_steps=1", "trainer.rl_steps=1",
                 "trainer.plot=false", "trainer.export=false", f"trainer.output_dir={tmp_path / 'out'}"])
    out = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert code == 0
    assert out[-1].startswith("held-out mean reward: initial "), out[-3:]
    summaries = [line for line in out if line.startswith("[") and "patches for model type" in line]
    # SFT's policy (the initial model) and RL's policy (the SFT model); RL's reference is
    # the same model as its policy and used to print the same line again.
    assert [line.split("]")[0] for line in summaries] == ["[sft policy", "[rl policy"], summaries
