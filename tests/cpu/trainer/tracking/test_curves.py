"""curves.png: every panel a user checks at a glance holds its curve, and the trainer redraws
the figure at each evaluation (not only at the end)."""
from __future__ import annotations

from matplotlib.figure import Figure

from polyfsdp.trainer.tracking import plot
from polyfsdp.trainer.tracking.metrics import MetricsLogger, read_metrics
from polyfsdp.trainer.train import main


def test_each_panel_draws_its_records(tmp_path, monkeypatch):
    metrics = MetricsLogger(str(tmp_path / "metrics.jsonl"))
    metrics.start(None)
    metrics.log({"phase": "eval", "tag": "initial", "global_step": 0, "reward": 0.1})
    metrics.log({"phase": "sft", "step": 1, "global_step": 1, "loss": 2.0, "grad_norm": 3.0, "step_time_s": 0.1})
    for step in (2, 3):
        metrics.log({"phase": "rl", "step": step - 1, "global_step": step, "reward": 0.2 * step, "loss": -0.1,
                     "kl": 0.01 * step, "entropy": 4.0 - step, "response_len": 5.0 + step, "clip_frac": 0.1,
                     "grad_norm": 1.0, "step_time_s": 0.2})
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    plot.plot_metrics(metrics.path, str(tmp_path / "curves.png"))
    axes = {ax.get_title(): ax for ax in figures[0].axes}
    assert list(axes) == [title for title, _ in plot.PANELS]
    assert [list(line.get_ydata()) for line in axes["entropy"].get_lines()[:1]] == [[2.0, 1.0]]
    assert [list(line.get_xdata()) for line in axes["KL to the reference"].get_lines()[:1]] == [[2, 3]]
    step_time = axes["step time (s)"].get_lines()
    assert [list(line.get_ydata()) for line in step_time[:2]] == [[0.1], [0.2, 0.2]]
    held_out = axes["mean reward"].get_lines()[1]
    assert list(held_out.get_xdata()) == [0] and list(held_out.get_ydata()) == [0.1]


def test_the_trainer_redraws_the_curves_at_every_evaluation(tmp_path, monkeypatch):
    drawn = []

    def record(metrics_path, png_path):
        drawn.append(read_metrics(metrics_path)[-1])
        return png_path

    monkeypatch.setattr(plot, "plot_metrics", record)
    out = tmp_path / "run"
    assert main(["trainer.sft_steps=2", "trainer.rl_steps=4", "trainer.eval_interval=2", "trainer.sft_batch_size=8",
                 "trainer.prompts_per_step=4", "data.eval_size=8", "algo.actor.group_size=4", "trainer.progress=off",
                 "trainer.export=false", "trainer.checkpoint_interval=0", f"trainer.output_dir={out}"]) == 0
    evals = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"]
    assert [r["tag"] for r in evals] == ["initial", "after_sft", "step", "final"]
    assert drawn == evals  # each drawn right after its evaluation was logged
