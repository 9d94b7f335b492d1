"""Guards of the sub-package layout (docs/architecture.md, "Layout and dependency direction"):
every sub-package says what it owns,
the engine's components import downward only, and ``trainer/run/`` is reached only from the entry
points. That every module has one name is tests/cpu/project/test_layout_names.py's."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PRODUCTION = ("backends", "patches", "engines", "trainer")
# The engine's components, lowest first: each imports only components before it.
ENGINE_ORDER = ("cancellation", "presets", "config", "jagged", "batch", "attention", "head", "parallel",
                "model", "losses", "checkpoint", "heads", "step_metrics", "engine", "memory_vision", "memory")
# Only these trainer modules may import the job's package (it composes everything else).
RUN_IMPORTERS = ("trainer/train.py", "trainer/eval_cli.py")


def _production_files():
    return [p for folder in PRODUCTION for p in sorted((ROOT / folder).rglob("*.py"))]


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return (".".join(parts[:-1]), True) if parts[-1] == "__init__" else (".".join(parts), False)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name without "polyfsdp.")`` of each polyfsdp module or name imported."""
    module, is_package = _module_name(path)
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name[len("polyfsdp."):]) for a in node.names if a.name.startswith("polyfsdp.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and node.module.startswith("polyfsdp."):
                target = node.module[len("polyfsdp."):]
            else:
                continue
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return found


def _engine_component(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if parts[0] == "engines" and len(parts) > 1 and parts[1] in ENGINE_ORDER else None


def test_every_package_says_what_it_owns():
    silent = [str(p.relative_to(ROOT)) for p in _production_files()
              if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not silent, "packages without a docstring: " + ", ".join(silent)


def test_engine_components_import_downward_only():
    violations, unknown = [], []
    for path in sorted((ROOT / "engines").rglob("*.py")):
        parts = path.relative_to(ROOT / "engines").with_suffix("").parts
        if parts == ("__init__",):
            continue  # the package's public face re-exports from every component
        own = parts[0]
        if own not in ENGINE_ORDER:
            unknown.append(own)
            continue
        for line, target in _imports(path):
            other = _engine_component(target)
            if other and other != own and ENGINE_ORDER.index(other) > ENGINE_ORDER.index(own):
                violations.append(f"engines/{'/'.join(parts)}.py:{line} ({own}) imports {other}")
    assert not unknown, f"engine components missing from ENGINE_ORDER: {sorted(set(unknown))}"
    assert not violations, "engine components import downward only:\n" + "\n".join(violations)


def test_the_job_package_is_reached_only_from_the_entry_points():
    violations = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("trainer/run/") or rel in RUN_IMPORTERS:
            continue
        violations += [f"{rel}:{line} imports {target}" for line, target in _imports(path)
                       if target == "trainer.run" or target.startswith("trainer.run.")]
    assert not violations, "only the entry points import trainer/run/:\n" + "\n".join(violations)


def test_the_downward_check_sees_an_upward_import(tmp_path, monkeypatch):
    probe = tmp_path / "engines" / "jagged" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..checkpoint import files\nfrom .checks import SIDES\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    targets = [_engine_component(t) for _, t in _imports(probe)]
    assert targets == ["checkpoint", "jagged"]

