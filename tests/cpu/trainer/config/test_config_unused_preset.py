"""With model.path the preset and its overrides are unused: the composed config (config.yaml,
--cfg) does not claim them, and a run saved before that still continues."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.run.resume import check_same_run


def test_model_path_drops_the_preset_and_its_overrides(tmp_path):
    cfg = load_config([f"model.path={tmp_path}"])
    assert cfg.raw["model"]["preset"] is None and cfg.raw["model"]["overrides"] == {}
    assert cfg.raw["model"]["path"] == str(tmp_path)
    assert load_config([]).raw["model"]["overrides"]  # a preset keeps its own


def test_a_run_saved_with_the_unused_overrides_still_continues(tmp_path):
    model_dir, run = tmp_path / "model", tmp_path / "run"
    model_dir.mkdir()
    (run / "checkpoints").mkdir(parents=True)
    old = load_config([f"model.path={model_dir}"]).raw
    old["model"] = {**old["model"], "preset": "qwen2-tiny", "overrides": {"hidden_size": 96}}  # as written before
    OmegaConf.save(OmegaConf.create(old), run / "config.yaml")
    check_same_run(load_config([f"model.path={model_dir}"]), run)  # no ConfigError
    with pytest.raises(ConfigError, match="model.path"):
        check_same_run(load_config([f"model.path={tmp_path}"]), run)  # another model still is one
