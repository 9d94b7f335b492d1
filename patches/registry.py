"""Patch registry: declare patches, apply the matching ones to ONE model instance, isolated and reversible.

Three explicit steps: :func:`register` a :class:`Patch`; :func:`apply_patches` applies every
enabled patch for the model's ``config.model_type`` whose fused ops the backend offers; the
returned :class:`PatchReport` can ``undo()`` them. Patches edit instances, never classes.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from polyfsdp.backends.distributed import current_rank

from .edits import EditLog
from .model_facts import model_facts
from .report import APPLIED, FAILED, SKIPPED, PatchReport
from .toggles import PatchToggles
from .verify import ProbeCase, capture, compare

logger = logging.getLogger(__name__)

Ops = Mapping[str, Callable]

# Modules that define patches; imported on first lookup (they import no model code themselves).
_CATALOGUE_MODULES = ("polyfsdp.patches.families",)
_MARKER = "_polyfsdp_patch_report"


def _ready(model: nn.Module, ops: Ops) -> str | None:
    return None


@dataclass(frozen=True)
class Patch:
    """One reversible change to one model instance.

    name: ``family.what`` (``qwen2.rms_norm``); model_types: ``config.model_type`` values it
    serves; ops: fused ops it needs from ``backend.fused_ops()`` (so any backend offering them
    gets it); check(model, ops) -> reason it cannot apply, or None; apply(model, ops, edits)
    makes its edits through ``edits`` (and may return an extra undo callable);
    probe(model) -> cases for numerical verification.
    """

    name: str
    model_types: tuple[str, ...]
    ops: tuple[str, ...]
    apply: Callable[[nn.Module, Ops, EditLog], Callable[[], None] | None]
    check: Callable[[nn.Module, Ops], str | None] = _ready
    probe: Callable[[nn.Module], list[ProbeCase]] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        family, dot, what = self.name.partition(".")
        if not (family and dot and what):
            raise ValueError(f"patch name must look like 'family.what' (e.g. 'qwen2.rms_norm'), got {self.name!r}")
        if isinstance(self.model_types, str) or isinstance(self.ops, str):
            raise TypeError(f"patch {self.name!r}: model_types and ops must be tuples of strings")

    @property
    def family(self) -> str:
        """The part of the name before the dot."""
        return self.name.partition(".")[0]


_PATCHES: dict[str, Patch] = {}
_catalogue_loaded = False


def register(patch: Patch, *, replace: bool = False) -> Patch:
    """Add ``patch`` to the registry (a second patch with the same name is an error unless ``replace``)."""
    if not isinstance(patch, Patch):
        raise TypeError(f"register expects a Patch, got {type(patch).__name__}")
    if patch.name in _PATCHES and not replace:
        raise ValueError(f"a patch named {patch.name!r} is already registered")
    _PATCHES[patch.name] = patch
    return patch


def unregister(name: str) -> None:
    """Remove a registered patch (tests register temporary ones)."""
    if name not in _PATCHES:
        raise KeyError(f"no patch named {name!r}; known patches: {', '.join(known_patch_names())}")
    del _PATCHES[name]


def _load_catalogue() -> None:
    global _catalogue_loaded
    if not _catalogue_loaded:
        _catalogue_loaded = True
        for module in _CATALOGUE_MODULES:
            importlib.import_module(module)


def known_patch_names() -> list[str]:
    """Every registered patch name, sorted."""
    _load_catalogue()
    return sorted(_PATCHES)


def known_families() -> list[str]:
    """Every family with at least one registered patch, sorted."""
    _load_catalogue()
    return sorted({p.family for p in _PATCHES.values()})


def patches_for(model_type: str | None) -> list[Patch]:
    """Registered patches serving this ``config.model_type``, in registration order."""
    _load_catalogue()
    return [p for p in _PATCHES.values() if model_type in p.model_types]


def validate_toggles(toggles: PatchToggles) -> PatchToggles:
    """Return ``toggles`` if every family and patch it disables is registered; an unknown
    name is a ValueError listing the known ones (a typo must not silently leave a patch on)."""
    families = known_families()
    for family in toggles.disable_families:
        if family not in families:
            raise ValueError(
                f"patches.disable_families: unknown family {family!r}; known families: {', '.join(families)}"
            )
    names = known_patch_names()
    for name in toggles.disable:
        if name not in names:
            raise ValueError(f"patches.disable: unknown patch {name!r}; known patches: {', '.join(names)}")
    return toggles


def _skip_reason(patch: Patch, toggles: PatchToggles, ops: Ops, backend_name: str) -> str | None:
    if not toggles.enabled:
        return "all patches off (patches.enabled=false)"
    if patch.family in toggles.disable_families:
        return f"family {patch.family!r} off (patches.disable_families)"
    if patch.name in toggles.disable:
        return "off (patches.disable)"
    for op in patch.ops:
        if op not in ops:
            return f"backend offers no {op} ({backend_name})"
    return None


def _limit_reason(patch: Patch, backend, facts) -> str | None:
    """The backend's objection to running this patch's ops on this model (a documented kernel
    limit its config violates), checked before the patch touches anything."""
    check = getattr(backend, "fused_op_unsupported", None)
    if facts is None or check is None:
        return None
    for op in patch.ops:
        reason = check(op, facts)
        if reason is not None:
            return reason
    return None


def _apply_one(patch: Patch, model: nn.Module, ops: Ops, verify: bool) -> tuple[str, str, EditLog | None]:
    """Apply one patch in isolation: any exception or failed verification rolls back its edits."""
    try:
        reason = patch.check(model, ops)
    except Exception as exc:
        return FAILED, f"readiness check raised {type(exc).__name__}: {exc}", None
    if reason is not None:
        return SKIPPED, reason, None
    cases: list[ProbeCase] = []
    originals = []
    if verify and patch.probe is not None:
        try:
            cases = patch.probe(model)
            originals = capture(cases)
        except Exception as exc:
            return FAILED, f"verification probe raised {type(exc).__name__}: {exc}", None
    edits = EditLog()
    try:
        extra_undo = patch.apply(model, ops, edits)
        if extra_undo is not None:
            edits.on_undo(extra_undo)
    except Exception as exc:
        edits.undo()
        return FAILED, f"{type(exc).__name__}: {exc} (partial changes undone)", None
    if cases:
        try:
            problem = compare(cases, originals, capture(cases))
        except Exception as exc:
            problem = f"verification raised {type(exc).__name__}: {exc}"
        if problem is not None:
            edits.undo()
            return FAILED, f"{problem}; rolled back", None
        return APPLIED, "verified", edits
    return APPLIED, ("not verified (no probe)" if verify else ""), edits


def _is_rank_zero() -> bool:
    return current_rank() == 0


def apply_patches(model: nn.Module, backend, toggles: PatchToggles | Mapping | None = None,
                  compute_dtype: torch.dtype | None = None) -> PatchReport:
    """Apply every enabled patch for ``model.config.model_type`` whose ops ``backend.fused_ops()`` has
    and whose ops the backend accepts for this model (``backend.fused_op_unsupported``; the model
    computes in ``compute_dtype``, default its parameters' dtype).

    Each patch is isolated: a failure is rolled back and reported, the others still apply.
    Returns a :class:`PatchReport`; ``report.undo()`` restores the model exactly.
    """
    toggles = validate_toggles(PatchToggles.from_config(toggles))
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_patches expects a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _MARKER, None) is not None:
        raise ValueError("patches are already applied to this model; call the previous report's undo() first")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    backend_name = getattr(backend, "name", type(backend).__name__)
    candidates = patches_for(model_type)
    report = PatchReport(model_type, backend_name)
    if not candidates:
        report.note = f"no patches registered for model type {model_type!r}; model left unchanged"
    ops = dict(backend.fused_ops())
    facts = model_facts(model, compute_dtype) if candidates else None
    for patch in candidates:
        reason = _skip_reason(patch, toggles, ops, backend_name) or _limit_reason(patch, backend, facts)
        if reason is not None:
            report._record(patch.name, SKIPPED, reason)
            continue
        status, reason, edits = _apply_one(patch, model, ops, toggles.verify)
        report._record(patch.name, status, reason, edits)
        if status == FAILED:
            logger.warning("patch %s failed and was rolled back: %s", patch.name, reason)
    if report.applied:
        marker = EditLog()
        marker.set_attr(model, _MARKER, report)
        report._logs.insert(0, marker)
    if _is_rank_zero():
        logger.info("%s", report)
    return report
