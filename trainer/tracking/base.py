"""The interface every experiment tracker implements (``trainer.logger``), and what it is told.

A tracker lives on rank 0 only. ``start`` either works or raises :class:`TrackerStartError`
with one line naming the fix; after that a failing call is the fan-out's business
(trainer/tracking/__init__.py): it warns once and drops the tracker, metrics.jsonl keeps
everything.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TrackerStartError


@dataclass
class RunInfo:
    """What a tracker needs to open (or reopen) the run."""

    directory: Path            # trainer.output_dir: trackers keep their files under it
    project: str               # trainer.project_name
    name: str                  # trainer.experiment_name (default: the output directory's name)
    tags: list[str]            # trainer.tags
    config: dict               # the resolved configuration (config.yaml's content)
    resume_id: str | None = None  # the id this tracker returned when the run started (a resumed run)
    flat_config: dict = field(init=False)

    def __post_init__(self) -> None:
        self.flat_config = flatten(self.config)


def flatten(tree: dict, prefix: str = "") -> dict[str, int | float | str | bool]:
    """``{"trainer.seed": 0, ...}``: every leaf of a nested mapping as a scalar (lists, None
    and other values as their JSON text), the shape hyperparameter tables want."""
    out: dict[str, int | float | str | bool] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


def require(module: str, tracker: str):
    """``module`` imported, or a TrackerStartError saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerStartError(f"trainer.logger={tracker}: {exc}; pip install 'polyfsdp[{tracker}]'") from None


class Tracker:
    """One experiment tracker. ``name`` is its ``trainer.logger`` entry and ``package`` what
    must be importable for it (the pip extra of the same name installs it)."""

    name = ""
    package = ""
    location = ""  # after start: where a user finds the run (printed once)

    def start(self, run: RunInfo) -> str | None:
        """Open the run (a new one, or ``run.resume_id``'s) and log ``run.config`` as its
        hyperparameters; returns the run id to reopen on resume (None: nothing to keep)."""
        raise NotImplementedError

    def continue_from(self, step: int) -> None:
        """Steps from ``step`` on are logged (again) from now: an earlier process may have
        logged some of them after the checkpoint this run resumed from."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Scalars at the run-wide ``step`` (polyfsdp's global step)."""
        raise NotImplementedError

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table (validation generations) at ``step``."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and end the run (a later resume reopens it)."""
