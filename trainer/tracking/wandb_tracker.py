"""``trainer.logger=[...,wandb]``: a Weights & Biases run (``pip install polyfsdp[wandb]``).

Its files go to ``OUTPUT_DIR/wandb``; ``WANDB_MODE=offline`` keeps everything there (``wandb
sync`` uploads it later), otherwise it needs ``wandb login`` (or ``WANDB_API_KEY``). A resumed
run reopens the same run id (``resume="allow"``). W&B keeps steps increasing: steps an earlier
process already logged after the checkpoint are not replaced (their values are the same:
a resumed run recomputes them exactly).

``run.finish()`` returns before W&B's service has written the run's files (with wandb 0.31 the
transaction log held only its 7-byte header after ``finish`` in 2 of 3 tries, everything after
the service closed the stream), so ``close`` also waits for the service (``wandb.teardown``)
when no other run of the process is open: when ``polyfsdp-train`` (or ``main()`` called from
Python) returns, ``OUTPUT_DIR/wandb`` is complete for ``wandb sync`` and for the next resume.
"""
from __future__ import annotations

from .base import RunInfo, Tracker, require
from ..errors import TrackerStartError

FILES_SUBDIR = "wandb"  # where wandb.init(dir=OUTPUT_DIR) keeps the run's files (wandb's own name)


class WandbTracker(Tracker):
    name = "wandb"
    package = "wandb"

    def start(self, run: RunInfo) -> str | None:
        self.wandb = wandb = require("wandb", self.name)
        try:
            self.run = wandb.init(project=run.project, name=run.name, tags=list(run.tags), dir=str(run.directory),
                                  id=run.resume_id, resume="allow" if run.resume_id else None,
                                  config=run.config, settings=wandb.Settings(console="off", quiet=True))
            if run.resume_id:
                # A resumed run may change step counts or intervals: the config shows the latest.
                self.run.config.update(run.config, allow_val_change=True)
        except Exception as exc:  # noqa: BLE001 - wandb raises many kinds; all mean "did not start"
            raise TrackerStartError(f"trainer.logger=wandb: wandb.init failed ({type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())[:200]}); run `wandb login`, or set "
                                    f"WANDB_MODE=offline to keep the run in {run.directory / FILES_SUBDIR}") from None
        self.location = (f"offline run {self.run.id} in {self.run.settings.sync_dir} (wandb sync uploads it)"
                         if self.run.offline else f"run {self.run.id}: {self.run.url}")
        return self.run.id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({key: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        if self.wandb.run is None:  # a run the caller's own code holds open keeps the service
            self.wandb.teardown()
