"""Old module paths keep importing after the move into sub-packages (docs/architecture.md,
"Layout"): ``import polyfsdp.engines.fused_logprob`` gives ``polyfsdp.engines.head.fused``, the
same module object. Each package that
moved modules installs one finder with its table (old name -> new name, both full)."""
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
