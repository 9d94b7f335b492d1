"""Per-model patches (fused ops), applied to one model instance, isolated, reversible, toggled by config.

``apply_patches(model, backend, toggles) -> PatchReport``; ``report.undo()`` restores the model.
Importing this package imports no model code: family classes are looked up when a model is patched.
"""
# Names are imported on first use (PEP 562), as polyfsdp.engines' are: the trainer declares
# ``patches``' configuration (toggles.py) without importing torch.
import importlib

_PUBLIC = {
    "EditLog": "edits",
    "Patch": "registry",
    "PatchOutcome": "report",
    "PatchReport": "report",
    "PatchToggles": "toggles",
    "ProbeCase": "verify",
    "apply_patches": "registry",
    "known_families": "registry",
    "known_patch_names": "registry",
    "patches_for": "registry",
    "register": "registry",
    "unregister": "registry",
    "validate_toggles": "registry",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
