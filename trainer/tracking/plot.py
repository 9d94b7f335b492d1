"""``curves.png`` from a metrics file (matplotlib, Agg: no display): one panel per quantity a
user checks at a glance (rewards, losses, KL, entropy, response length, clip fraction, gradient
norm, step time; an asynchronous run's staleness and idle times) against the global step; the trainer redraws it at every evaluation."""
from __future__ import annotations

import logging

from .metrics import read_metrics

CURVES_FILE = "curves.png"  # in the output directory, redrawn at every evaluation

logger = logging.getLogger(__name__)

# (title, [(phase, record key, legend label, matplotlib format)]): the first two panels are the
# reward and the loss, in that order.
PANELS = (
    ("mean reward", [("rl", "reward", "RL train reward (sampled)", "-"),
                     ("eval", "reward", "held-out reward", "o-")]),
    ("loss", [("sft", "loss", "SFT loss (NLL)", "-"), ("rl", "loss", "RL loss", "-")]),
    ("KL to the reference", [("rl", "kl", "RL kl", "-")]),
    ("entropy", [("rl", "entropy", "RL entropy", "-")]),
    ("response length (tokens)", [("rl", "response_len", "RL response length", "-")]),
    ("clip fraction", [("rl", "clip_frac", "RL clip fraction", "-")]),
    ("gradient norm", [("sft", "grad_norm", "SFT", "-"), ("rl", "grad_norm", "RL", "-")]),
    ("step time (s)", [("sft", "step_time_s", "SFT", "-"), ("rl", "step_time_s", "RL", "-")]),
)
# Drawn only for an asynchronous run (rollout.max_staleness > 0; trainer/algos/sample_ahead.py).
ASYNC_PANEL = ("asynchronous RL", [("rl", "async/staleness", "staleness (policy versions)", "-"),
                                   ("rl", "async/trainer_wait_time_s", "trainer waiting for samples (s)", "--"),
                                   ("rl", "async/sampler_idle_time_s", "sampler idle (s)", ":")])


def _curve(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(global steps, values) of the records that hold ``key``: an RL step whose groups all
    had equal rewards (algo.actor.filter_groups) trains nothing and logs no loss."""
    having = [r for r in records if key in r]
    # metrics.jsonl stores non-finite numbers as "nan"/"inf" strings (valid JSON); plotted as
    # strings they would turn the axis categorical.
    return [r["global_step"] for r in having], [float(r[key]) for r in having]


def plot_metrics(metrics_path: str, png_path: str) -> str:
    """Draw every panel of :data:`PANELS` that has data (an empty one says so); returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    by_phase: dict[str, list[dict]] = {}
    for r in records:
        by_phase.setdefault(r.get("phase"), []).append(r)
    sft, rl = by_phase.get("sft", []), by_phase.get("rl", [])
    panels = PANELS + ((ASYNC_PANEL,) if any("async/staleness" in r for r in rl) else ())
    columns = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, columns, figsize=(4 * columns, 7), sharex=True)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    for ax, (title, lines) in zip(axes.flat, panels):
        for phase, key, label, fmt in lines:
            steps, values = _curve(by_phase.get(phase, []), key)
            if steps:
                ax.plot(steps, values, fmt, lw=1, ms=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if sft and rl:
            ax.axvline(sft[-1]["global_step"], color="grey", ls="--", lw=0.8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    axes.flat[0].set_ylim(-0.02, 1.02)
    for ax in axes[1]:
        ax.set_xlabel("global step")
    fig.suptitle("polyfsdp-train: SFT warm-up, then RL (dashed: SFT end)" if sft and rl else "polyfsdp-train")
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.08, top=0.9, wspace=0.22, hspace=0.25)  # tight_layout: 2x slower
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    return png_path
