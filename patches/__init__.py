"""Per-model patches (fused ops), applied to one model instance, isolated, reversible, toggled by config.

``apply_patches(model, backend, toggles) -> PatchReport``; ``report.undo()`` restores the model.
Importing this package imports no model code: family classes are looked up when a model is patched.
"""
from .edits import EditLog
from .registry import (
    Patch,
    apply_patches,
    known_families,
    known_patch_names,
    patches_for,
    register,
    unregister,
    validate_toggles,
)
from .report import PatchOutcome, PatchReport
from .toggles import PatchToggles
from .verify import ProbeCase

__all__ = [
    "EditLog",
    "Patch",
    "PatchOutcome",
    "PatchReport",
    "PatchToggles",
    "ProbeCase",
    "apply_patches",
    "known_families",
    "known_patch_names",
    "patches_for",
    "register",
    "unregister",
    "validate_toggles",
]
