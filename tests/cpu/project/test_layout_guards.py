"""Guards that keep the layout docs/architecture.md describes: imports point one way, the
wheel ships every package, the paths the docs cite exist, the engine YAML and the engine
dataclass give the same defaults."""
from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from pathlib import Path


from tests.helpers import ROOT
from polyfsdp.engines.config import EngineConfig, LoraConfig, OptimConfig
from polyfsdp.trainer.config.composition import compose, to_container

# Lower layers never import higher ones: trainer -> engines -> patches -> backends.
LAYERS = {"backends": 0, "patches": 1, "engines": 2, "trainer": 3}
# The docs whose cited paths must exist: the README and every page of docs/ (docs_pages()).
README = "README.md"
CITED_PATH = re.compile(r"`((?:backends|patches|engines|trainer|configs|tests|benchmarks|scripts|docs)/[^`\s]*)`")


def _imported_layers(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level polyfsdp folder)`` of every polyfsdp import in ``path``."""
    found = []
    # A relative import counts from the module's folder (for an __init__.py: its own package).
    module_package = path.relative_to(ROOT).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_package[:len(module_package) - node.level + 1]
                names = [".".join(("polyfsdp", *base, *([node.module] if node.module else [])))]
            elif node.module:
                names = [node.module]
        for name in names:
            pieces = name.split(".")
            if pieces[0] == "polyfsdp" and len(pieces) > 1 and pieces[1] in LAYERS:
                found.append((node.lineno, pieces[1]))
    return found


def _upward_imports() -> list[str]:
    violations = []
    for folder, layer in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, target in _imported_layers(path):
                if LAYERS[target] > layer:
                    violations.append(f"{path.relative_to(ROOT)}:{line} imports polyfsdp.{target}")
    return violations


def test_the_import_check_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    engines = tmp_path / "engines" / "sub"
    engines.mkdir(parents=True)
    probe = engines / "probe.py"
    probe.write_text("from ...trainer import job\nimport polyfsdp.trainer.config.job\nfrom ..backends import x\n"
                     "from . import sibling\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert [target for _, target in _imported_layers(probe)] == ["trainer", "trainer", "engines",
                                                                              "engines"]


def test_imports_point_one_way():
    violations = _upward_imports()
    assert not violations, "upward imports (trainer -> engines -> patches -> backends):\n" + "\n".join(violations)


def _source_packages() -> set[str]:
    packages = set()
    for init in ROOT.glob("*/**/__init__.py"):
        folder = init.parent.relative_to(ROOT)
        if folder.parts[0] in (*LAYERS, "configs"):
            packages.add(".".join(("polyfsdp", *folder.parts)))
    return packages


def test_the_wheel_lists_every_package():
    """pyproject names packages one by one (the source folders sit at the top level, mapped
    under ``polyfsdp.``): a sub-package missing there is missing from a non-editable install."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    assert listed == _source_packages(), "pyproject [tool.setuptools] packages vs folders with __init__.py"


def docs_pages(root: Path = ROOT) -> list[str]:
    """README.md and every docs/*.md page, relative to ``root``."""
    return [README, *sorted(p.relative_to(root).as_posix() for p in (root / "docs").glob("*.md"))]


def _cited_paths(root: Path = ROOT) -> list[tuple[str, str]]:
    cited = []
    for doc in docs_pages(root):
        for match in CITED_PATH.finditer((root / doc).read_text()):
            path = re.split(r"[:(]", match.group(1))[0]  # `file.py:Name`, `file.py::test`
            if not any(c in path for c in "<*{"):  # templates such as `backends/<name>.py`
                cited.append((doc, path))
    return cited


def _missing_cited_paths(root: Path = ROOT) -> list[str]:
    return [f"{doc}: {path}" for doc, path in _cited_paths(root) if not (root / path).exists()]


def test_every_path_the_docs_cite_exists():
    cited = _cited_paths()
    assert len(cited) > 50, "the citation pattern stopped matching the docs"
    assert {doc for doc, _ in cited} >= {"README.md", "docs/architecture.md", "docs/checkpoints-and-resume.md"}
    missing = _missing_cited_paths()
    assert not missing, "paths cited in the docs that do not exist:\n" + "\n".join(missing)


def test_the_cited_path_check_reads_the_readme_and_every_page(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "here.py").write_text("")
    (tmp_path / "README.md").write_text("`trainer/here.py` and `trainer/gone.py`\n")
    (tmp_path / "docs" / "a-new-page.md").write_text("`trainer/here.py:Name`, `tests/cpu/missing.py::test`, "
                                                     "`backends/<name>.py`\n")
    assert _missing_cited_paths(tmp_path) == ["README.md: trainer/gone.py", "docs/a-new-page.md: tests/cpu/missing.py"]


def _defaults(config_class) -> dict:
    return {f.name: f.default for f in dataclasses.fields(config_class)}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def test_composed_engine_defaults_equal_engine_config_defaults():
    shipped = to_container(compose(["trainer.output_dir=x"]))["engine"]
    assert shipped == {name: _plain(value) for name, value in _defaults(EngineConfig).items()}


def test_model_lora_defaults_equal_lora_config_defaults():
    for family in sorted((ROOT / "configs" / "model").glob("*.yaml")):
        lora = to_container(compose([f"model={family.stem}", "trainer.output_dir=x"]))["model"]["lora"]
        assert lora == {name: _plain(value) for name, value in _defaults(LoraConfig).items()}, family.name


# The phases' optimizer settings are the job's tuning for its tiny default model and differ
# from OptimConfig's API defaults on purpose (OptimConfig.lr=1e-5 suits a pretrained model).
JOB_TUNED_OPTIM_FIELDS = {"lr", "impl"}


def test_phase_optim_yaml_has_every_optim_field_and_api_defaults_elsewhere():
    api = {name: _plain(value) for name, value in _defaults(OptimConfig).items()}
    for algo in sorted((ROOT / "configs" / "algo").glob("*.yaml")):
        composed = to_container(compose([f"algo={algo.stem}", "trainer.output_dir=x"]))["algo"]
        for phase, section in composed.items():
            if not isinstance(section, dict) or "optim" not in section:
                continue
            optim = section["optim"]
            assert set(optim) == set(api), f"{algo.name}: {phase}.optim keys"
            differing = {k for k in api if optim[k] != api[k]}
            assert differing <= JOB_TUNED_OPTIM_FIELDS, f"{algo.name}: {phase}.optim differs from OptimConfig in " \
                f"{sorted(differing - JOB_TUNED_OPTIM_FIELDS)}"
