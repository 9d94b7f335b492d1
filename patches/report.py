"""What apply_patches did to one model: applied, skipped (why), failed (why); undo restores it."""
from __future__ import annotations

from dataclasses import dataclass

from .edits import EditLog

APPLIED, SKIPPED, FAILED = "applied", "skipped", "failed"


@dataclass(frozen=True)
class PatchOutcome:
    """One patch's result; ``reason`` says why it was skipped or failed (or a note when applied)."""

    name: str
    status: str
    reason: str = ""


class PatchReport:
    """The outcome of :func:`apply_patches` on one model; ``str(report)`` is a table."""

    def __init__(self, model_type: str | None, backend_name: str, note: str = "") -> None:
        self.model_type = model_type
        self.backend_name = backend_name
        self.note = note
        self.outcomes: list[PatchOutcome] = []
        self._logs: list[EditLog] = []
        self.undone = False

    def _record(self, name: str, status: str, reason: str = "", log: EditLog | None = None) -> None:
        self.outcomes.append(PatchOutcome(name, status, reason))
        if log is not None:
            self._logs.append(log)

    @property
    def applied(self) -> list[str]:
        """Names of the patches now in effect (empty after :meth:`undo`)."""
        return [] if self.undone else [o.name for o in self.outcomes if o.status == APPLIED]

    @property
    def skipped(self) -> dict[str, str]:
        """Patch name -> why it was not attempted."""
        return {o.name: o.reason for o in self.outcomes if o.status == SKIPPED}

    @property
    def failed(self) -> dict[str, str]:
        """Patch name -> why it was attempted and rolled back."""
        return {o.name: o.reason for o in self.outcomes if o.status == FAILED}

    def undo(self) -> None:
        """Remove every applied patch, newest first; the model computes exactly as before."""
        while self._logs:
            self._logs.pop().undo()
        self.undone = True

    def summary(self) -> str:
        """One line: model type, backend and counts."""
        counts = f"{len(self.applied)} applied, {len(self.skipped)} skipped, {len(self.failed)} failed"
        undone = " (undone)" if self.undone else ""
        return f"patches for model type {self.model_type!r} on backend {self.backend_name!r}: {counts}{undone}"

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.note:
            lines.append(self.note)
        if self.outcomes:
            rows = [("patch", "status", "reason")] + [(o.name, o.status, o.reason) for o in self.outcomes]
            widths = [max(len(row[i]) for row in rows) for i in range(2)]
            for name, status, reason in rows:
                lines.append(f"  {name:<{widths[0]}}  {status:<{widths[1]}}  {reason}".rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<PatchReport {self.summary()}>"
