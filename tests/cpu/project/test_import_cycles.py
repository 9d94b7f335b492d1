"""No import circles among polyfsdp's modules.

Two checks, each with a negative control on a made-up package that has a circle:
- every module of backends/, patches/, engines/ and trainer/ imports on its own in a clean
  interpreter (polyfsdp's modules are dropped from ``sys.modules`` before each one, so no earlier
  import hides a circle that only breaks when that module is the first one imported);
- the module-level imports (read by AST; imports inside functions run later and are excluded,
  as are ``if TYPE_CHECKING:`` blocks) form no cycle, so no module ever runs half-initialised.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

FOLDERS = ("backends", "patches", "engines", "trainer")

# Run in a fresh interpreter: argv[1] is a JSON list of module names, argv[2] the prefix of the
# modules to drop before each import (the package under test); prints the failures as JSON.
IMPORT_EACH_ALONE = """
import importlib, json, sys

names, prefix = json.loads(sys.argv[1]), sys.argv[2]
failures = []
for name in names:
    for loaded in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failures.append(f"{name}: {type(exc).__name__}: {exc}")
print(json.dumps(failures))
"""


def _modules(root: Path, package: str, folders) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module under ``folders`` of ``root``, named as
    ``package.<folder>...`` (the folders are installed as ``polyfsdp.<folder>``)."""
    found = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join(p for p in (package, *parts) if p)] = path
    return found


def _import_failures(names: list[str], prefix: str, cwd: Path) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE, json.dumps(names), prefix], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _module_level(body: list[ast.stmt]):
    """The statements that run when the module is imported: not function bodies, not
    ``if TYPE_CHECKING:`` blocks (class bodies and other blocks do run)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _module_level(node.orelse)
            continue
        yield node
        for block in ("body", "orelse", "finalbody"):
            yield from _module_level(getattr(node, block, []))
        for handler in getattr(node, "handlers", []):
            yield from _module_level(handler.body)


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports at module level (``from . import x``
    counts as ``x`` when it is a module, else as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _module_level(ast.parse(path.read_text(), filename=str(path)).body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.add(f"{source}.{alias.name}")
                elif source in modules:
                    found.add(source)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another in a circle (strongly connected, > 1)."""
    order, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return groups


def _module_level_cycles(root: Path, package: str, folders) -> list[list[str]]:
    modules = _modules(root, package, folders)
    return _cycles({name: _imported_modules(name, path, modules) for name, path in modules.items()})


def _circular_package(tmp_path: Path) -> Path:
    """``circ``: ``a`` imports ``b`` at module level, ``b`` imports ``a``; ``c`` imports ``a``
    only inside a function (no circle)."""
    package = tmp_path / "circ"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import B\nA = 1\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nfrom .a import A\nB = 2\n"
                                  "if TYPE_CHECKING:\n    from .c import C\n")
    (package / "c.py").write_text("def late():\n    from .a import A\n    return A\nC = 3\n")
    return package


def test_every_module_imports_on_its_own():
    names = list(_modules(ROOT, "polyfsdp", FOLDERS))
    assert len(names) > 100 and "polyfsdp.trainer.errors" in names
    failures = _import_failures(names, "polyfsdp", ROOT)
    assert not failures, "modules that do not import on their own:\n" + "\n".join(failures)


def test_the_isolated_import_check_sees_a_circle(tmp_path):
    _circular_package(tmp_path)
    failures = _import_failures(["circ.a", "circ.b", "circ.c"], "circ", tmp_path)
    assert [f.split(":")[0] for f in failures] == ["circ.a", "circ.b"]
    assert all("circular import" in f for f in failures)


def test_no_module_level_import_cycle():
    cycles = _module_level_cycles(ROOT, "polyfsdp", FOLDERS)
    assert not cycles, "modules importing one another at module level:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_module_level_circles_only(tmp_path):
    _circular_package(tmp_path)
    # c's import of a runs in a function, b's of c only under TYPE_CHECKING: neither closes a cycle.
    assert _module_level_cycles(tmp_path, "", ["circ"]) == [["circ.a", "circ.b"]]
