"""``trainer.logger=[...,mlflow]``: an MLflow run (``pip install polyfsdp[mlflow]``).

The store is ``MLFLOW_TRACKING_URI`` when set, else a SQLite file ``OUTPUT_DIR/mlflow.db``
with artifacts in ``OUTPUT_DIR/mlartifacts`` (``mlflow ui --backend-store-uri
sqlite:///OUTPUT_DIR/mlflow.db`` shows it). The experiment is ``trainer.project_name``, the run
``trainer.experiment_name``; a resumed run logs to the same run id. MLflow keeps every value
it was given, so steps an earlier process logged after the checkpoint appear twice, with the
same values (a resumed run recomputes them exactly).
"""
from __future__ import annotations

import json
import os
import time

from .base import RunInfo, Tracker, require
from ..errors import TrackerStartError

PARAMS_PER_BATCH = 100   # MLflow's log_batch limit
STORE_FILE = "mlflow.db"  # the local store in the output directory, written in place by SQLite
ARTIFACTS_SUBDIR = "mlartifacts"  # the local store's artifacts, beside it
PARAM_VALUE_CHARS = 500  # the shortest value limit of MLflow's stores


def metric_name(key: str) -> str:
    """MLflow allows letters, digits and ``_-. /:`` in names: ``pass@4`` -> ``pass_at_4``."""
    return key.replace("@", "_at_")


class MlflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow"

    def start(self, run: RunInfo) -> str | None:
        MlflowClient = require("mlflow.tracking", self.name).MlflowClient
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            uri = f"sqlite:///{run.directory / STORE_FILE}"
        try:
            from mlflow.entities import Param

            self.client = MlflowClient(tracking_uri=uri)
            if run.resume_id:
                self.run_id = run.resume_id
                logged = self.client.get_run(self.run_id).data.params
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                experiment = self.client.get_experiment_by_name(run.project)
                experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                    run.project, artifact_location=(run.directory / ARTIFACTS_SUBDIR).as_uri() if local else None)
                tags = {tag: "true" for tag in run.tags}
                self.run_id = self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
                logged = {}
            # Parameters cannot change once logged: a resumed run adds only keys new to the run.
            params = [Param(k, str(v)[:PARAM_VALUE_CHARS]) for k, v in run.flat_config.items() if k not in logged]
            for i in range(0, len(params), PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])
        except Exception as exc:  # noqa: BLE001 - store errors come in many types
            raise TrackerStartError(f"trainer.logger=mlflow: cannot open the run at {uri} ({type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())[:200]}); check MLFLOW_TRACKING_URI "
                                    f"(unset: a SQLite store in trainer.output_dir)") from None
        self.location = f"run {self.run_id} in {uri}"
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(metric_name(k), float(v), now, step)
                                                    for k, v in metrics.items()])

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        table = {"columns": columns, "data": rows}
        self.client.log_text(self.run_id, json.dumps(table, indent=1), f"{key}/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
