"""trainer.logger: TensorBoard, W&B (offline) and MLflow (local store) hold a run's metrics,
read back with each library's own reader; a resumed run continues the same tracker run; a
tracker that fails never loses the run; only installed, known trackers start."""
from __future__ import annotations

import importlib.util
import json
import logging
import os

import pytest

from polyfsdp.trainer import tracking
from polyfsdp.trainer.errors import TrackerStartError
from polyfsdp.trainer.tracking import tracker_metrics
from polyfsdp.trainer.tracking.base import Tracker
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main

TINY = ["trainer.sft_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4", "data.eval_size=8",
        "trainer.progress=lines", "algo.actor.group_size=4", "trainer.plot=false", "trainer.export=false"]
INSTALLED = [name for name in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(name) is not None]


def _records(out, phase):
    return [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == phase]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """GRPO to step 2 with a checkpoint every step, then continued from step 1's checkpoint to
    step 3: global step 4 is logged twice (before and after the resume), as after a kill."""
    if not INSTALLED:
        pytest.skip("no tracker installed (pip install 'polyfsdp[tensorboard,wandb,mlflow]')")
    out = tmp_path_factory.mktemp("tracked") / "run"
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT", "MLFLOW_TRACKING_URI")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    common = [*TINY, f"trainer.logger=[console,jsonl,{','.join(INSTALLED)}]", "trainer.experiment_name=tiny",
              "trainer.tags=[ci,tiny]", "trainer.checkpoint_interval=1", "trainer.log_val_generations=2",
              f"trainer.output_dir={out}"]
    try:
        assert main([*common, "trainer.rl_steps=2"]) == 0
        ids_first = json.loads((out / "trackers.json").read_text())
        assert main([*common, "trainer.rl_steps=3",
                     f"trainer.resume={out / 'checkpoints' / 'rl' / 'step_000001'}"]) == 0
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    return out, ids_first


def test_validation_generations_reach_the_file_and_the_trackers(resumed_run):
    from polyfsdp.trainer.evaluation.generations_log import read_generations
    from polyfsdp.trainer.rewards.rules import char_match

    out, _ = resumed_run
    rows = read_generations(str(out / "generations.jsonl"))
    # Two prompts per evaluation; the first process's final evaluation (global step 4) was dropped.
    assert [(r["global_step"], r["tag"]) for r in rows] == [(0, "initial")] * 2 + [(2, "after_sft")] * 2 + \
        [(5, "final")] * 2
    assert [r["prompt"] for r in rows[:2]] == [r["prompt"] for r in rows[2:4]]  # the same prompts each time
    for r in rows:
        assert r["reward"] == char_match("", r["completion"], r["ground_truth"])
    if "tensorboard" in INSTALLED:
        # The accumulator TensorBoard's server reads text through (it purges tensors too).
        from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
        events.Reload()
        tables = events.Tensors("val/generations/text_summary")
        assert [e.step for e in tables] == [0, 2, 5]
        assert rows[-1]["ground_truth"] in tables[-1].tensor_proto.string_val[0].decode()
    if "wandb" in INSTALLED:
        from tests.helpers.tracker_files import wandb_offline_runs

        logged = [row for run in wandb_offline_runs(out / "wandb") for row in run["history"]
                  if "val/generations/_type" in row]
        assert [row["_step"] for row in logged] == [0, 2, 4, 5]  # W&B keeps the first process's step 4
        assert all(row["val/generations/_type"] == "table-file" and row["val/generations/nrows"] == 2
                   for row in logged)


def test_records_become_phase_named_scalars():
    record = {"phase": "rl", "step": 2, "global_step": 4, "reward": 0.5, "loss": float("nan"), "tag": "x",
              "ok": True, "tokens_per_s": 10}
    assert tracker_metrics(record) == {"rl/reward": 0.5, "rl/tokens_per_s": 10.0}


def test_tensorboard_event_files_hold_every_step_once_after_resume(resumed_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = resumed_run
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for phase, key in (("rl", "loss"), ("rl", "reward"), ("sft", "loss"), ("eval", "reward")):
        expected = [(r["global_step"], r[key]) for r in _records(out, phase)]
        logged = [(e.step, e.value) for e in events.Scalars(f"{phase}/{key}")]
        # Global step 4 came twice; purge_step dropped the first process's copy (and its final eval).
        assert [s for s, _ in logged] == [s for s, _ in expected], (phase, key)
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [s for s, _ in expected] == [0, 2, 5]
    assert "config/text_summary" in events.Tags()["tensors"]


def test_wandb_offline_runs_share_one_id_and_hold_the_history(resumed_run):
    pytest.importorskip("wandb")
    from tests.helpers.tracker_files import wandb_offline_runs

    out, ids_first = resumed_run
    first, second = wandb_offline_runs(out / "wandb")
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]
    assert first["id"] == second["id"] == run_id == ids_first["wandb"]  # `wandb sync` makes them one run
    assert (first["name"], first["project"], first["tags"]) == ("tiny", "polyfsdp", ["ci", "tiny"])
    assert first["config"]["trainer"]["seed"] == 0 and second["config"]["trainer"]["rl_steps"] == 3

    def losses(run):
        return {row["_step"]: row["rl/loss"] for row in run["history"] if "rl/loss" in row}

    expected = {r["global_step"]: r["loss"] for r in _records(out, "rl")}
    assert losses(first) == pytest.approx({3: expected[3], 4: expected[4]})
    assert losses(second) == pytest.approx({4: expected[4], 5: expected[5]})


def test_mlflow_store_holds_one_run_with_metrics_and_params(resumed_run):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    out, ids_first = resumed_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("polyfsdp")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids_first["mlflow"]]
    run = runs[0]
    assert run.info.run_name == "tiny" and {"ci", "tiny"} <= set(run.data.tags)
    assert run.data.params["trainer.seed"] == "0" and run.data.params["algo.name"] == "grpo"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rl/loss"))
    expected = {r["global_step"]: r["loss"] for r in _records(out, "rl")}
    # MLflow keeps both copies of global step 4: the same value, recomputed after the resume.
    assert [s for s, _ in history] == [3, 4, 4, 5]
    assert [v for _, v in history] == pytest.approx([expected[s] for s, _ in history])
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "val/generations")]
    # One JSON table per evaluation; the first process's step-4 table stays (artifacts are kept).
    assert tables == [f"val/generations/step_{s:06d}.json" for s in (0, 2, 4, 5)]
    (out / "downloaded").mkdir(exist_ok=True)
    local = client.download_artifacts(run.info.run_id, tables[-1], str(out / "downloaded"))
    table = json.loads(open(local).read())
    assert table["columns"] == ["prompt", "completion", "ground_truth", "reward"] and len(table["data"]) == 2


class _Flaky(Tracker):
    name, package = "flaky", ""
    calls: list = []

    def start(self, run):
        return None

    def log_metrics(self, metrics, step):
        self.calls.append(step)
        if len(self.calls) == 3:
            raise OSError("disk full")

    def log_table(self, key, columns, rows, step):
        pass


def test_a_tracker_failing_mid_run_is_one_warning_and_the_run_completes(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(tracking.TRACKERS, "flaky", _Flaky)
    _Flaky.calls = []
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="polyfsdp.trainer.tracking"):
        assert main([*TINY, "trainer.rl_steps=2", "trainer.logger=[console,jsonl,flaky]",
                     f"trainer.output_dir={out}"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "flaky failed" in r.getMessage()]
    assert len(warnings) == 1 and "disk full" in warnings[0] and "metrics.jsonl keeps every record" in warnings[0]
    assert len(_Flaky.calls) == 3  # dropped after the failure
    phases = [(r["phase"], r.get("step"), r.get("tag")) for r in read_metrics(str(out / "metrics.jsonl"))]
    assert phases == [("eval", None, "initial"), ("sft", 1, None), ("sft", 2, None), ("eval", None, "after_sft"),
                      ("rl", 1, None), ("rl", 2, None), ("eval", None, "final")]


class _CannotStart(_Flaky):
    name = "broken"

    def start(self, run):
        raise TrackerStartError("trainer.logger=broken: no server at localhost:1; start it or drop broken")


class _NotInstalled(_Flaky):
    name, package = "absent", "polyfsdp_no_such_package"


@pytest.mark.parametrize("logger,expected", [
    ("[console,jsonl,broken]", "trainer.logger=broken: no server at localhost:1; start it or drop broken"),
    ("[console,jsonl,absent]", "trainer.logger: absent needs the polyfsdp_no_such_package package; "
                               "pip install 'polyfsdp[absent]'"),
    ("[console,tensorboard]", "add jsonl to the list"),
    ("[console,jsonl,neptune]", "trainer.logger: unknown logger 'neptune'"),
])
def test_a_tracker_that_cannot_start_is_one_line(tmp_path, monkeypatch, capsys, logger, expected):
    monkeypatch.setitem(tracking.TRACKERS, "broken", _CannotStart)
    monkeypatch.setitem(tracking.TRACKERS, "absent", _NotInstalled)
    assert main([*TINY, "trainer.rl_steps=1", f"trainer.logger={logger}",
                 f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polyfsdp-train: error: ") and expected in err[0], err


def test_without_console_no_step_lines_are_printed(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "trainer.rl_steps=1", "trainer.logger=[jsonl]", f"trainer.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "[rl] step" not in printed and "held-out mean reward" in printed


def test_wandb_files_are_complete_when_the_tracker_closes(tmp_path, monkeypatch):
    """W&B's service writes the transaction log after ``run.finish()`` returns (wandb 0.31: only
    the file's header in 2 of 3 tries); closing the tracker must leave the file complete, as
    ``wandb sync`` and a resumed run read it. Three runs: the race showed in most tries."""
    pytest.importorskip("wandb")
    from polyfsdp.trainer.tracking.base import RunInfo
    from polyfsdp.trainer.tracking.wandb_tracker import WandbTracker
    from tests.helpers.tracker_files import wandb_offline_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for attempt in range(3):
        directory = tmp_path / f"run{attempt}"
        directory.mkdir()
        tracker = WandbTracker()
        run_id = tracker.start(RunInfo(directory=directory, project="polyfsdp", name="closing", tags=[],
                                       config={"trainer": {"seed": attempt}}))
        for step in range(6):
            tracker.log_metrics({"rl/loss": float(step)}, step=step)
        tracker.close()
        (run,) = wandb_offline_runs(directory / "wandb")
        assert run.get("id") == run_id, f"try {attempt}: the run record is not in the file yet"
        assert [row["_step"] for row in run["history"]] == list(range(6)), attempt
