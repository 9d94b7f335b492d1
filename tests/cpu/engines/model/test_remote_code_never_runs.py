"""A model directory's own Python code never runs: its config (``--estimate``, the engine) is read
with ``trust_remote_code=False``, so an ``auto_map`` is a one-line refusal, never a [y/N] prompt."""
import json
import os
import subprocess
import sys

import pytest
from transformers import AutoConfig

from polyfsdp.engines.config import ModelConfig
from polyfsdp.engines.memory import hf_config_of


@pytest.fixture()
def directory_with_code(tmp_path):
    """A model directory whose config names its own configuration class; importing that class
    creates ``marker``."""
    model_dir, marker = tmp_path / "model", tmp_path / "ran"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "not_a_transformers_model", "auto_map": {"AutoConfig": "configuration_own.OwnConfig"}}))
    (model_dir / "configuration_own.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class OwnConfig(PretrainedConfig):\n    model_type = 'not_a_transformers_model'\n")
    return model_dir, marker


def test_the_directory_code_is_live(directory_with_code):
    """Negative control: trusted, the directory's code runs."""
    model_dir, marker = directory_with_code
    AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=True)
    assert marker.exists()


def test_reading_the_config_refuses_the_directory_code(directory_with_code):
    model_dir, marker = directory_with_code
    with pytest.raises(ValueError, match="ModelConfig.path: could not read a model config") as info:
        hf_config_of(ModelConfig(path=str(model_dir)))
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_estimate_refuses_the_directory_code_in_one_line(directory_with_code, tmp_path):
    model_dir, marker = directory_with_code
    proc = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", f"model.path={model_dir}",
                           f"trainer.output_dir={tmp_path / 'run'}", "--estimate"],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "POLYFSDP_BACKEND": ""})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "could not read a model config" in lines[0] and "auto_map" in lines[0] and "Traceback" not in proc.stdout
    assert not marker.exists()
