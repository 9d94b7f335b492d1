"""Module paths from before the move into sub-packages keep working (docs/architecture.md,
"Inside engines/ and trainer/"). ``import polyfsdp.engines.fused_logprob`` gives
``polyfsdp.engines.head.fused``, the same module object: each package that moved modules
installs one finder with its table (old name -> new name, both full). A package that took the
name of a module it now holds (``trainer.config`` holds the old ``config.py`` as ``job.py``)
resolves that module's names on first use (:func:`names_of`)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module name to the module at its new name (imported on first use)."""

    def __init__(self, moved: dict[str, str]) -> None:
        self.moved = moved
        self._own_specs: dict[str, object] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(self.moved[spec.name])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system has just stamped the old name's spec on the shared module object;
        # the module is the new one, so its own spec goes back.
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


def install(moved: dict[str, str]) -> None:
    """Add a finder for ``moved`` unless one with the same table is installed already."""
    if not any(isinstance(f, MovedModuleFinder) and f.moved == moved for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder(moved))


def names_of(package: str, module: str):
    """The ``__getattr__`` of a package that took the name of a module it now holds as
    ``package.module``: a submodule is imported as itself; any other name is that module's,
    imported on first use (so the package itself stays as light as its submodules)."""

    def __getattr__(name: str):
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        try:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
