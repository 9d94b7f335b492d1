"""PNG of the reward and loss curves from a metrics file (matplotlib, Agg: no display)."""
from __future__ import annotations

import logging

from .metrics import read_metrics

logger = logging.getLogger(__name__)


def _curve(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(global steps, values) of the records that hold ``key``: a GRPO step whose groups all
    had equal rewards (algo.grpo.filter_groups) trains nothing and logs no loss."""
    having = [r for r in records if key in r]
    # metrics.jsonl stores non-finite numbers as "nan"/"inf" strings (valid JSON); plotted as
    # strings they would turn the axis categorical.
    return [r["global_step"] for r in having], [float(r[key]) for r in having]


def plot_metrics(metrics_path: str, png_path: str) -> str:
    """Draw reward (GRPO train mean, held-out evaluations) and loss (SFT, GRPO) against
    the global step; returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    sft = [r for r in records if r.get("phase") == "sft"]
    grpo = [r for r in records if r.get("phase") == "grpo"]
    evals = [r for r in records if r.get("phase") == "eval"]
    fig, (ax_r, ax_l) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    if grpo:
        ax_r.plot(*_curve(grpo, "reward"), lw=1, alpha=0.6,
                  label="GRPO train reward (sampled)")
    if evals:
        ax_r.plot(*_curve(evals, "reward"), "o-", color="C3",
                  label="held-out reward (greedy)")
    ax_r.set_ylabel("mean reward")
    ax_r.set_ylim(-0.02, 1.02)
    if sft:
        ax_l.plot(*_curve(sft, "loss"), lw=1, label="SFT loss (NLL)")
    if grpo:
        ax_l.plot(*_curve(grpo, "loss"), lw=1, label="GRPO loss")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("global step")
    for ax in (ax_r, ax_l):
        if sft and grpo:
            ax.axvline(sft[-1]["global_step"], color="grey", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    title = "polyfsdp-train: SFT warm-up, then GRPO" if sft and grpo else "polyfsdp-train"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
