"""Every module has one name (docs/architecture.md, "Layout and dependency direction"): a name is
imported from the module that defines it, never from a module that merely imports it, and a
module is imported at the path of its file. The one exception is a package face: a package
listed in ``PUBLIC_FACES`` offers the names of its ``__all__`` as its API.

Checked everywhere code imports polyfsdp: the packages, tests, benchmarks, examples and scripts,
the Python blocks of README.md and docs/, and the dotted paths written as strings
(``monkeypatch.setattr("polyfsdp....")``, ``importlib.import_module(...)``, ``-m polyfsdp....``)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

# The top-level folders installed as polyfsdp.<folder> (pyproject's package-dir).
PACKAGE_FOLDERS = ("backends", "patches", "engines", "trainer", "configs")
# Folders that hold no code of the repository's own.
SKIPPED_FOLDERS = {".git", "__pycache__", "build", "dist", "node_modules"}
DOCS = ("README.md", "docs")
# Packages whose __init__ is a deliberate public API: the names of their ``__all__`` may be
# imported from the package although a submodule defines them. Any other name is imported from
# the module that defines it.
PUBLIC_FACES = (
    "polyfsdp.backends",            # get_backend, init_distributed, the collectives (loaded on first use)
    "polyfsdp.engines",             # FSDPEngine, the configs, the losses, make_jagged (README's engine example)
    "polyfsdp.engines.checkpoint",  # save/load and what a caller needs around them
    "polyfsdp.engines.jagged",      # every layout conversion in one import
    "polyfsdp.engines.losses",      # "the engine's losses in one import"
    "polyfsdp.patches",             # apply_patches and its report, toggles and registry
)
DOTTED = re.compile(r"(?<![\w.])polyfsdp(?:\.\w+)+")


def _code_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not any(part in SKIPPED_FOLDERS or part.endswith(".egg-info") or part.startswith(".")
                             for part in p.relative_to(ROOT).parts[:-1]))


def _module_file(dotted: str) -> Path | None:
    """The file of module ``polyfsdp.<...>``, or None when no file has that name."""
    parts = dotted.split(".")
    if parts[0] != "polyfsdp" or len(parts) < 2 or parts[1] not in PACKAGE_FOLDERS:
        return None
    base = ROOT.joinpath(*parts[1:])
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _top_level_bindings(path: Path) -> tuple[set[str], set[str]]:
    """``(defined, imported)``: the names a module binds at its top level by a definition or an
    assignment, and those it binds by an import."""
    defined, imported = set(), set()

    def names_in(target) -> set[str]:
        return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}

    def visit(body) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    defined.update(names_in(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                defined.update(names_in(node.target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                if isinstance(node, ast.For):
                    defined.update(names_in(node.target))
                if isinstance(node, ast.With):
                    for item in node.items:
                        if item.optional_vars is not None:
                            defined.update(names_in(item.optional_vars))
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, None) or [])
                for handler in getattr(node, "handlers", None) or []:
                    visit(handler.body)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return defined, imported


_BINDINGS: dict[Path, tuple[set[str], set[str]]] = {}
_FACES: dict[str, set[str]] = {}


def _bindings(path: Path) -> tuple[set[str], set[str]]:
    if path not in _BINDINGS:
        _BINDINGS[path] = _top_level_bindings(path)
    return _BINDINGS[path]


def _face(module: str) -> set[str]:
    if module not in PUBLIC_FACES:
        return set()
    if module not in _FACES:
        _FACES[module] = set(importlib.import_module(module).__all__)
    return _FACES[module]


def _own_package(path: Path) -> str | None:
    """The package a relative import in ``path`` counts from (None outside polyfsdp)."""
    parts = path.relative_to(ROOT).parts
    if parts[0] not in PACKAGE_FOLDERS:
        return None
    return ".".join(("polyfsdp", *parts[:-1]))


def _name_problem(module: str, name: str, *, imported_ok: bool = False) -> str | None:
    """Why ``name`` should not be taken from ``module`` (None when it may)."""
    if _module_file(f"{module}.{name}"):
        return None  # a submodule
    file = _module_file(module)
    if file is None:
        return f"no module {module}"
    defined, imported = _bindings(file)
    if name in defined or name in _face(module) or (imported_ok and name in imported):
        return None
    if name in imported:
        return f"{name} from {module}, which only imports it"
    return f"{name} from {module}, which does not define it"


def _import_problems(tree: ast.AST, package: str | None) -> list[tuple[int, str]]:
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            problems += [(node.lineno, f"no module {a.name}") for a in node.names
                         if a.name.startswith("polyfsdp.") and _module_file(a.name) is None]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if package is None:
                    continue
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "polyfsdp" or (node.module or "").startswith("polyfsdp."):
                module = node.module
            else:
                continue
            for alias in node.names:
                problem = (f"import * from {module}" if alias.name == "*"
                           else _name_problem(module, alias.name))
                if problem:
                    problems.append((node.lineno, problem))
    return problems


def _dotted_problem(dotted: str) -> str | None:
    """A dotted path written as text: its longest module prefix must exist and the next name must
    be bound there (a monkeypatch may replace a name where it is imported, so imported is fine)."""
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        module = ".".join(parts[:end])
        if _module_file(module):
            if end == len(parts):
                return None
            problem = _name_problem(module, parts[end], imported_ok=True)
            return problem and f"{dotted}: {problem}"
    return None  # not under a package folder (polyfsdp itself, polyfsdp.configs' YAML, ...)


def _string_problems(tree: ast.AST) -> list[tuple[int, str]]:
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in DOTTED.finditer(node.value):
                problem = _dotted_problem(match.group(0).rstrip("."))
                if problem:
                    problems.append((node.lineno, problem))
    return problems


def _python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line, code)`` of each fenced Python block of a Markdown page."""
    blocks = []
    for match in re.finditer(r"^```python[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


def _problems_in_code() -> list[str]:
    problems = []
    for path in _code_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        found = _import_problems(tree, _own_package(path))
        if path != Path(__file__).resolve():  # this file's strings are the check's own examples
            found += _string_problems(tree)
        problems += [f"{path.relative_to(ROOT)}:{line}: {why}" for line, why in found]
    return problems


def _doc_pages() -> list[Path]:
    return [p for entry in DOCS for p in ([ROOT / entry] if entry.endswith(".md") else sorted((ROOT / entry).rglob("*.md")))]


def test_every_name_is_imported_from_the_module_that_defines_it():
    problems = _problems_in_code()
    assert not problems, ("import each name from the module that defines it (or from a package in "
                          "PUBLIC_FACES, a name of its __all__):\n" + "\n".join(problems))


def test_every_import_in_the_docs_is_from_the_module_that_defines_it():
    problems = []
    blocks = 0
    for page in _doc_pages():
        for first, code in _python_blocks(page.read_text()):
            blocks += 1
            tree = ast.parse(code)
            problems += [f"{page.relative_to(ROOT)}:{first + line - 1}: {why}"
                         for line, why in _import_problems(tree, None)]
    assert blocks >= 4, "the Python-block pattern stopped matching the docs"
    assert not problems, "\n".join(problems)


def test_every_dotted_path_the_docs_name_exists():
    problems = []
    for page in _doc_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in DOTTED.finditer(line):
                problem = _dotted_problem(match.group(0).rstrip("."))
                if problem:
                    problems.append(f"{page.relative_to(ROOT)}:{number}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_public_faces_define_every_name_of_their_api():
    for face in PUBLIC_FACES:
        package = importlib.import_module(face)
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert not missing, f"{face}.__all__ names what it does not have: {missing}"


@pytest.mark.parametrize("source, expected", [
    # a re-export: the module imports the name it is asked for
    ("from polyfsdp.trainer.run.job import JobConfig\n",
     "JobConfig from polyfsdp.trainer.run.job, which only imports it"),
    ("from polyfsdp.trainer.config.job import ConfigError, build_job_config\n",
     "ConfigError from polyfsdp.trainer.config.job, which only imports it"),
    # relative, from a package that is no public face
    ("from ..config import JobConfig\n", "JobConfig from polyfsdp.trainer.config, which does not define it"),
    # a face, outside its __all__
    ("from polyfsdp.engines.checkpoint import save_plain\n",
     "save_plain from polyfsdp.engines.checkpoint, which only imports it"),
    # an old module path
    ("import polyfsdp.engines.fused_logprob\n", "no module polyfsdp.engines.fused_logprob"),
    ("x = 'polyfsdp.trainer.job.build_source'\n", "polyfsdp.trainer.job.build_source: job from polyfsdp.trainer, "
                                                  "which does not define it"),
])
def test_the_check_sees_a_second_name(source, expected):
    tree = ast.parse(source)
    found = [why for _, why in _import_problems(tree, "polyfsdp.trainer.rewards") + _string_problems(tree)]
    assert found == [expected]


@pytest.mark.parametrize("source", [
    "from polyfsdp.trainer.config.job import build_job_config\n",  # defined there
    "from polyfsdp.trainer.config import job\n",  # a submodule
    "from polyfsdp.engines import FSDPEngine\n",  # a face's __all__
    "from ..errors import ConfigError\n",
    "x = 'polyfsdp.trainer.run.job.init_distributed'\n",  # monkeypatched where it is imported
])
def test_the_check_accepts_the_defining_module(source):
    tree = ast.parse(source)
    assert _import_problems(tree, "polyfsdp.trainer.rewards") + _string_problems(tree) == []


@pytest.mark.parametrize("old", ["polyfsdp.engines.fused_logprob", "polyfsdp.trainer.job"])
def test_a_module_path_from_before_the_sub_packages_no_longer_imports(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
