"""A continued run's ``time_s`` goes on from the run's clock instead of restarting at 0."""
from __future__ import annotations

import json

import torch

from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main

TINY = ["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
        "data.eval_size=8", "trainer.progress=off", "trainer.plot=false",
        "trainer.export=false"]
EARLIER = 1000.0  # seconds the first run is made to have taken: far beyond any CPU time of this test


def test_time_s_continues_from_the_checkpointed_clock(tmp_path):
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        assert main(["algo=sft", *TINY, f"trainer.output_dir={out}"]) == 0
        metrics = out / "metrics.jsonl"
        first = read_metrics(str(metrics))
        # As if the SFT phase (an algo=sft run, continued into GRPO below) had run for a long time before the stop.
        metrics.write_text("".join(json.dumps({**r, "time_s": r["time_s"] + EARLIER}) + "\n" for r in first))
        assert main([*TINY, "algo.actor.group_size=4", f"trainer.output_dir={out}", "trainer.resume=auto"]) == 0
    finally:
        torch.set_num_threads(threads)
    records = read_metrics(str(metrics))
    continued = [r for r in records if r["phase"] == "rl"]
    assert len(continued) == 2
    clock = [r["time_s"] for r in records]
    assert clock == sorted(clock), clock  # never back to 0
    assert all(r["time_s"] > EARLIER for r in continued), clock
