"""``trainer.logger=[...,tensorboard]``: event files in ``OUTPUT_DIR/tensorboard`` through
``torch.utils.tensorboard`` (needs the ``tensorboard`` package: ``pip install polyfsdp[tensorboard]``).

A resumed run appends a new event file to the same directory, opened with ``purge_step``:
TensorBoard then drops the earlier files' events from that step on (those logged after the
checkpoint the run resumed from), so every step shows once.
"""
from __future__ import annotations

from .base import RunInfo, Tracker, require
from ..errors import TrackerStartError

LOG_SUBDIR = "tensorboard"


def _markdown_table(columns: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    package = "tensorboard"

    def start(self, run: RunInfo) -> str | None:
        require("torch.utils.tensorboard", self.name)  # imports the tensorboard package
        self.run, self.writer = run, None
        self.logdir = run.directory / LOG_SUBDIR
        self.location = f"tensorboard --logdir {self.logdir}"
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrackerStartError(f"trainer.logger=tensorboard: cannot create {self.logdir}: "
                                    f"{exc.strerror or exc}; choose a writable trainer.output_dir") from None
        return None

    def continue_from(self, step: int) -> None:
        self._open(purge_step=step)

    def _open(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        if self.writer is not None:
            self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=purge_step)
        # The HParams plugin's table plus the whole config as text (the plugin shows scalars only).
        for summary in hparams(self.run.flat_config, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in self.run.flat_config.items()))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            self._open(purge_step=None)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        if self.writer is None:
            self._open(purge_step=None)
        self.writer.add_text(key, _markdown_table(columns, rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
