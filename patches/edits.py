"""A log of attribute edits on one model, so a patch can be rolled back exactly."""
from __future__ import annotations

import logging
import types
from typing import Any, Callable

from torch import nn

logger = logging.getLogger(__name__)

_MISSING = object()


class EditLog:
    """Records every change a patch makes; :meth:`undo` reverts them newest-first.

    A patch edits only through this log, so an exception halfway through a patch can be
    rolled back without the patch knowing how far it got.
    """

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` on the instance, remembering how to restore it."""
        registry = next((table for table in ("_modules", "_parameters", "_buffers")
                         if isinstance(obj, nn.Module) and name in getattr(obj, table)), None)
        if registry is not None:
            # Submodules, parameters and buffers live in these tables, not in __dict__.
            old = getattr(obj, registry)[name]
            self._steps.append(lambda: getattr(obj, registry).__setitem__(name, old))
        else:
            old = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
            if old is _MISSING:
                # Only class-level (or no) attribute before: deleting the instance one restores it.
                self._steps.append(lambda: delattr(obj, name))
            else:
                self._steps.append(lambda: setattr(obj, name, old))
        setattr(obj, name, value)

    def replace_forward(self, module: nn.Module, forward: Callable) -> None:
        """Bind ``forward(module, ...)`` as this one instance's forward."""
        self.set_attr(module, "forward", types.MethodType(forward, module))

    def on_undo(self, step: Callable[[], None]) -> None:
        """Run ``step`` when the log is undone (after the edits recorded later)."""
        self._steps.append(step)

    def undo(self) -> None:
        """Revert every recorded edit, newest first; the log is empty afterwards."""
        errors = []
        while self._steps:
            step = self._steps.pop()
            try:
                step()
            except Exception as exc:  # keep reverting the rest; report the first failure
                logger.error("patch undo step failed: %s: %s", type(exc).__name__, exc)
                errors.append(exc)
        if errors:
            raise RuntimeError(f"{len(errors)} undo step(s) failed; first: {errors[0]!r}") from errors[0]
