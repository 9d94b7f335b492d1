"""Metrics as JSON lines (rank 0 writes; other ranks hold a no-op logger).

Each record carries ``phase`` (sft, rl, rl_update, eval), the phase ``step`` and the run-wide
``global_step``, so the SFT and RL curves form one x-axis. A resumed run first cuts the
file back to the line count stored in its checkpoint, then appends: the curve continues
exactly where the checkpoint left it, with no duplicated or orphaned records. A record is
appended whole or not at all: a write that fails partway (a full disk) is cut back off and
raised as a one-line :class:`MetricsWriteError`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Callable

from ..errors import DataError, MetricsWriteError

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# Wall-clock fields differ between two runs of the same job; everything else must not.
TIMING_KEYS = ("time_s", "step_time_s", "gen_time_s", "weight_sync_time_s", "tokens_per_s",
               "multi_turn/env_time_s_mean", "async/trainer_wait_time_s", "async/sampler_idle_time_s")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Append-only JSONL writer that knows how many lines it holds."""

    def __init__(self, path: str, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        self.lines = 0
        self.history: list[dict] = []
        # Called with every record logged (the experiment trackers' fan-out, trainer/tracking).
        self.on_record: Callable[[dict], None] | None = None

    def start(self, keep_lines: int | None) -> None:
        """Start fresh (``keep_lines=None``) or keep the first ``keep_lines`` records of an
        earlier run's file (resume) and continue after them."""
        kept: list[str] = []
        if not self.enabled:
            # Other ranks only count lines; reading would race with rank 0 rewriting the file.
            self.history, self.lines = [], keep_lines or 0
            return
        if keep_lines and os.path.isfile(self.path):
            kept, self.history, torn = _read_kept(self.path, keep_lines)
            if len(kept) < keep_lines and not torn:  # a torn line has said so already
                logger.warning("%s has %d records, the checkpoint expected %d", self.path, len(kept), keep_lines)
        else:
            self.history = []
        self.lines = len(kept)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        if os.path.islink(tmp):  # a crafted run's link to any file: opening it would overwrite that file
            os.unlink(tmp)
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def log(self, record: dict) -> None:
        """Append one record (flushed at once, so a killed run loses nothing it logged)."""
        record = {k: _clean(v) for k, v in record.items()}
        if self.enabled:
            _append_whole(self.path, (json.dumps(record) + "\n").encode())
        self.history.append(record)
        self.lines += 1
        if self.on_record is not None:
            self.on_record(record)

    def next_global_step(self) -> int:
        """The global step after the newest record held (0 for an empty file): where a
        (resumed) run's new records start."""
        return max((int(r["global_step"]) + 1 for r in self.history if "global_step" in r), default=0)

    def elapsed_s(self) -> float:
        """The run's time (``time_s``) at the newest record held: where a resumed run's clock
        continues (0.0 for an empty file)."""
        return max((float(r["time_s"]) for r in self.history if "time_s" in r), default=0.0)

    def last(self, phase: str, tag: str | None = None) -> dict | None:
        """The newest record of ``phase`` (and eval ``tag``), or None."""
        for record in reversed(self.history):
            if record.get("phase") == phase and (tag is None or record.get("tag") == tag):
                return record
        return None


def _append_whole(path: str, data: bytes) -> None:
    """Append ``data`` with unbuffered writes; if one fails, truncate the file back to its
    size before, so no torn line is left for a resumed run (or a reader) to trip over."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError as exc:
            os.ftruncate(fd, size)
            raise MetricsWriteError(f"cannot append a record to {path}: {exc.strerror or exc} "
                                    f"(the file keeps its {size} bytes of whole records)") from None
    finally:
        os.close(fd)


def _read_kept(path: str, keep_lines: int) -> tuple[list[str], list[dict], bool]:
    """The first ``keep_lines`` records of ``path`` (their lines, newline-ended, and parsed) and
    whether a torn last line was dropped. A killed run can leave its last line torn (a partial
    write): that line, the file's last, is dropped with one printed line. A damaged line with
    records after it is not a torn write but damage nobody can repair by guessing: one DataError
    naming the file and the line."""
    with open(path) as f:
        numbered = [(number, line) for number, line in enumerate(f, start=1) if line.strip()]
    kept: list[str] = []
    records: list[dict] = []
    for i, (number, line) in enumerate(numbered[:keep_lines]):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not a record")
        except ValueError as exc:
            where = f"{path} line {number}"
            if i == len(numbered) - 1:
                print(f"warning: {where} is a torn last record (a killed run's partial write); "
                      f"dropped it and continuing from the {len(kept)} records before it", file=sys.stderr,
                      flush=True)
                return kept, records, True
            raise DataError(f"{where} is not a JSON record ({' '.join(str(exc).split())}) and records follow "
                            f"it, so it is not a torn last write; repair or delete that line and resume "
                            f"again") from None
        # A kept last line may lack its newline (written by hand): the next record must not join it.
        kept.append(line if line.endswith("\n") else line + "\n")
        records.append(record)
    return kept, records, False


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
