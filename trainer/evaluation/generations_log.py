"""``generations.jsonl``: the validation completions ``trainer.log_val_generations`` keeps,
one JSON line per (evaluation, prompt), and the RL rollouts' ``trainer.log_rollout_samples``
(tag ``rollout``), on rank 0. A resumed run first drops the lines from
the global step it continues at (an earlier process wrote them after the checkpoint)."""
from __future__ import annotations

import json
import os

GENERATIONS_FILE = "generations.jsonl"


class GenerationsLog:
    def __init__(self, path: str, enabled: bool = True) -> None:
        self.path, self.enabled = path, enabled

    def start(self, next_step: int, drop: tuple[str, int] | None = None) -> None:
        """Keep the lines of global steps before ``next_step`` (none for a fresh run: 0), but not
        those of ``drop`` = ``(tag, global step)``: an evaluation the resumed run does again."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            rows = [(line, json.loads(line)) for line in f if line.strip()]
        kept = [line for line, row in rows if row["global_step"] < next_step and (row["tag"], row["global_step"]) != drop]
        tmp = self.path + ".tmp"
        if os.path.islink(tmp):  # a crafted run's link to any file: opening it would overwrite that file
            os.unlink(tmp)
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def write(self, tag: str, global_step: int, columns: list[str], rows: list[list]) -> None:
        """One line per row: ``global_step``, ``tag`` and the row's ``columns``."""
        if not self.enabled or not rows:
            return
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps({"global_step": global_step, "tag": tag, **dict(zip(columns, row))}) + "\n")
            f.flush()


def read_generations(path: str) -> list[dict]:
    """Every line of a generations file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
