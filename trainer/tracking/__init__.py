"""Experiment trackers (``trainer.logger``): TensorBoard, W&B and MLflow next to the
console lines and ``metrics.jsonl``, on rank 0 only.

``console`` is the step progress on stdout (``trainer.progress`` picks bar or lines) and
``jsonl`` is ``metrics.jsonl``, the run's own record that resume, curves and the result read
(so it is always in the list). Every other entry is one :class:`~.base.Tracker` module.
:class:`Trackers` fans each metrics record out to them: a tracker that fails mid-run is
reported once and dropped, and the run goes on (metrics.jsonl has everything). The run id
each tracker returned is kept in ``OUTPUT_DIR/trackers.json`` so a resumed run reopens it.

Beside the trackers: ``metrics.jsonl`` itself (metrics.py) and ``curves.png`` drawn from it
(plot.py).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

from .base import RunInfo, Tracker
from ..errors import ConfigError, TrackerStartError
from .mlflow_tracker import MlflowTracker
from .tensorboard_tracker import TensorBoardTracker
from .wandb_tracker import WandbTracker

logger = logging.getLogger(__name__)

BUILTIN_OUTPUTS = ("console", "jsonl")
# name -> tracker class; tests register stand-ins here.
TRACKERS: dict[str, type[Tracker]] = {cls.name: cls for cls in (TensorBoardTracker, WandbTracker, MlflowTracker)}
IDS_FILE = "trackers.json"
# Record fields that place a record rather than measure something.
PLACEMENT_KEYS = ("phase", "step", "global_step", "tag", "update")


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that fails to import; a module without a spec
        return False


def check_loggers(value) -> list[str]:
    """``trainer.logger`` as a list of known, installed names (a single name is a list of one);
    anything else is a ConfigError naming the fix."""
    from ..errors import ConfigError

    names = [value] if isinstance(value, str) else value
    known = (*BUILTIN_OUTPUTS, *TRACKERS)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"trainer.logger: expected a list of names, e.g. trainer.logger=[console,jsonl,tensorboard], "
                          f"got {value!r}")
    for name in names:
        if name not in known:
            raise ConfigError(f"trainer.logger: unknown logger {name!r}; known: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"trainer.logger: {names} names a logger twice")
    if "jsonl" not in names:
        raise ConfigError(f"trainer.logger={names}: metrics.jsonl is the run's own record (resume, curves and the "
                          f"result read it); add jsonl to the list")
    for name in names:
        package = TRACKERS[name].package if name in TRACKERS else None
        if package and not _installed(package):
            raise ConfigError(f"trainer.logger: {name} needs the {package} package; pip install 'polyfsdp[{name}]' "
                              f"(or drop {name} from trainer.logger)")
    return names


def tracker_metrics(record: dict) -> dict[str, float]:
    """A metrics record's finite numbers, named ``<phase>/<field>`` (``grpo/reward``, ``eval/reward``)."""
    phase = record.get("phase", "run")
    out = {}
    for key, value in record.items():
        if key in PLACEMENT_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[f"{phase}/{key}"] = float(value)
    return out


class Trackers:
    """The trackers of one run (none on ranks other than 0), behind one set of calls."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def _each(self, call: str, step: int | None, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker must never end the run
                self.trackers.remove(tracker)
                where = f" at global step {step}" if step is not None else ""
                logger.warning("trainer.logger: %s failed%s (%s: %s); it is off for the rest of this run, "
                               "metrics.jsonl keeps every record", tracker.name, where, type(exc).__name__,
                               " ".join(str(exc).split())[:200])

    def locations(self) -> str:
        """``name: where`` of every tracker, for the run's first lines."""
        return "; ".join(f"{t.name}: {t.location}" for t in self.trackers)

    def continue_from(self, step: int) -> None:
        """Records from global step ``step`` on follow (see :meth:`Tracker.continue_from`)."""
        self._each("continue_from", step, step)

    def log_record(self, record: dict) -> None:
        """One metrics.jsonl record, at its global step; per-update records stay in the file."""
        if not self.trackers or str(record.get("phase", "")).endswith("_update") or "global_step" not in record:
            return
        metrics = tracker_metrics(record)
        if metrics:
            self._each("log_metrics", record["global_step"], metrics, record["global_step"])

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        self._each("log_table", step, key, columns, rows, step)

    def close(self) -> None:
        self._each("close", None)
        self.trackers = []


def start_trackers(names: list[str], run: RunInfo, resuming: bool) -> Trackers:
    """Start the trackers ``names`` asks for (rank 0). ``resuming`` reopens the runs whose ids
    ``run.directory/trackers.json`` holds; the ids are (re)written for the next resume."""
    if not any(name in TRACKERS for name in names):
        return Trackers([])
    ids_path = Path(run.directory) / IDS_FILE
    saved = json.loads(ids_path.read_text()) if resuming and ids_path.is_file() else {}
    started, ids = [], {}
    try:
        for name in names:
            if name not in TRACKERS:
                continue
            tracker = TRACKERS[name]()
            run_id = tracker.start(replace(run, resume_id=saved.get(name)))
            started.append(tracker)
            if run_id is not None:
                ids[name] = run_id
    except TrackerStartError:
        Trackers(started).close()
        raise
    ids_path.write_text(json.dumps({**saved, **ids}, indent=1))
    return Trackers(started)


def start_run_trackers(trainer, directory: Path, config: dict, resuming: bool) -> Trackers:
    """A job's ``trainer.logger`` trackers (``trainer``: its TrainerSection) for the run in
    ``directory``, named by ``trainer.project_name``/``experiment_name``/``tags``; one that
    cannot start is a ConfigError (one line, the run stops before it trains)."""
    run = RunInfo(directory=directory, project=trainer.project_name,
                  name=trainer.experiment_name or Path(directory).name, tags=list(trainer.tags), config=config)
    try:
        return start_trackers(trainer.logger, run, resuming)
    except TrackerStartError as exc:
        raise ConfigError(str(exc)) from None
