"""Each configuration default is declared once, in its section (trainer/config/sections.py,
trainer/config/algo.py, engines/config.py, trainer/rollout/servers/settings.py): the YAML under
configs/ holds presets and overrides only, Hydra composes the declarations through its
ConfigStore, and docs/config-reference.md is generated from them."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from polyfsdp.trainer.config.bounds import defaults_of
from polyfsdp.trainer.config.composition import compose, to_container
from polyfsdp.trainer.config.reference import PAGE, group_sections, optional_sections, page
from polyfsdp.trainer.errors import ConfigError

CONFIGS = ROOT / "configs"


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _without_own(group: str, path: Path) -> tuple[dict, dict]:
    """(the file's own keys, what its defaults list gives before them)."""
    data = yaml.safe_load(path.read_text()) or {}
    below: dict = {}
    for entry in data.pop("defaults", []):
        if entry == "_self_":
            continue
        if entry == "base":
            below = _merge(below, defaults_of(group_sections()[group]))
        elif entry.startswith("/schema/"):
            location, _, package = entry[len("/schema/"):].partition("@")
            below = _merge(below, {package: defaults_of(optional_sections()[location.replace("/", ".")])})
        else:
            own, under = _without_own(group, path.parent / f"{entry}.yaml")
            below = _merge(under, own)
    return data, below


def _repeated(own: dict, below: dict, prefix: str) -> list[str]:
    out = []
    for key, value in own.items():
        if isinstance(value, dict) and isinstance(below.get(key), dict) and below[key]:
            out += _repeated(value, below[key], f"{prefix}.{key}")
        elif key in below and value == below[key] and type(value) is type(below[key]):
            out.append(f"{prefix}.{key}")
    return out


GROUP_FILES = [(group, path) for group in group_sections() for path in sorted((CONFIGS / group).glob("*.yaml"))]


@pytest.mark.parametrize("group, path", GROUP_FILES, ids=[f"{g}/{p.name}" for g, p in GROUP_FILES])
def test_no_group_option_repeats_a_declared_default(group, path):
    own, below = _without_own(group, path)
    assert below, f"{path.relative_to(ROOT)}: its defaults list must start from the declared base"
    repeated = _repeated(own, below, group)
    assert not repeated, f"{path.relative_to(ROOT)} repeats the declared defaults of {repeated}"


def test_every_declared_key_is_in_the_composed_config_with_its_default():
    raw = to_container(compose(["trainer.output_dir=x"]))
    for group, cls in group_sections().items():
        declared = defaults_of(cls)
        assert set(raw[group]) == set(declared), group
    assert raw["engine"] == defaults_of(group_sections()["engine"])
    assert raw["rollout"] == defaults_of(group_sections()["rollout"])


def test_the_reference_page_is_generated_from_the_declarations():
    assert PAGE.read_text() == page(), "run: python -m polyfsdp.trainer.config.reference"


def test_help_lists_every_key_with_its_default_and_range(capsys):
    from polyfsdp.trainer.train import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "  trainer.seed = 0  [0, 4294967295]" in text
    assert '  algo.sft.optim.lr = 1e-05 (default job: "${if_model_path:1.0e-5,3.0e-3}")  [-1e9, 1.0]' in text
    assert "  rollout.server.count = 1" in text


def test_a_run_saved_without_later_declared_keys_continues(tmp_path):
    """A config.yaml saved before a key was declared (or by a preset that did not compose it) is
    compared as if the key had its declared default: the run used that value."""
    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.run.resume import check_same_run

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ab", "answer": "ba"}\n' * 200)
    overrides = ["algo=sft", "data=jsonl", f"data.path={data}", f"trainer.output_dir={tmp_path}"]
    cfg = load_config(overrides)
    saved = copy.deepcopy(cfg.raw)
    for key in ("alphabet", "min_len", "max_len", "task"):
        del saved["data"][key]
    for key in ("adv_estimator", "actor", "critic", "distill", "rollout_correction"):
        del saved["algo"][key]
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    check_same_run(cfg, tmp_path)  # no ConfigError
    saved["data"]["eval_size"] = 7
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="data.eval_size=7"):
        check_same_run(cfg, tmp_path)
