"""On-policy distillation on the built-in task: a teacher (the preset trained ``--teacher-sft-steps``
SFT steps) and students started from the untrained preset (or ``--student-sft-steps`` of SFT in
their own run), trained ``--steps`` RL steps with ``algo.distill.teacher`` set; prints the mean
per-token reverse KL to the teacher (``distill/reverse_kl``) over the first and last 5 steps and the
held-out greedy reward at each evaluation, beside the teacher's.

    python benchmarks/distill_toy_task.py --out /tmp/distill_bench                 # docs/algorithms.md's table
    python benchmarks/distill_toy_task.py --out /tmp/distill_bench --steps 100 --settings distill

Settings (all with ``algo.actor.kl_coef=0``: the student starts far from any reference worth keeping):

    distill       pure distillation: ``algo.distill.task_weight=0`` (the rewards are only logged)
    distill+task  the reverse-KL advantage added to GRPO's task advantage (``task_weight=1``)
    grpo          GRPO alone, the teacher only measured (``algo.distill.coef=0``): the control

tests/cpu/benchmarks/test_distill_toy_task.py runs a few steps of it.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main as train

SETTINGS = {
    "distill": ["algo.distill.task_weight=0"],
    "distill+task": ["algo.distill.task_weight=1"],
    "grpo": ["algo.distill.coef=0"],
}
COMMON = ["trainer.checkpoint_interval=0", "trainer.plot=false", "trainer.progress=off", "algo.actor.kl_coef=0"]
WINDOW = 5  # steps averaged at each end of the KL curve


def _run(overrides: list[str], quiet: bool) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
        code = train(overrides)
    if code != 0:
        raise SystemExit(f"polyfsdp-train {' '.join(overrides)} failed with {code}:\n{out.getvalue()[-2000:]}")


def _evaluations(run_dir: Path) -> dict[int, float]:
    return {r["global_step"]: r["reward"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if r["phase"] == "eval"}


def teacher(out: Path, sft_steps: int, quiet: bool) -> tuple[Path, float]:
    """The teacher's export and its held-out reward (trained once per ``out``)."""
    run_dir = out / f"teacher_sft{sft_steps}"
    if not (run_dir / "final" / "config.json").is_file():
        _run(["algo=sft", f"trainer.sft_steps={sft_steps}", f"trainer.output_dir={run_dir}", *COMMON[:3]], quiet)
    evaluations = _evaluations(run_dir)
    return run_dir / "final", evaluations[max(evaluations)]


def student(out: Path, name: str, teacher_dir: Path, args) -> dict:
    """One setting's run: its KL curve's ends and its held-out rewards by RL step."""
    run_dir = out / f"{name.replace('+', '_')}_sft{args.student_sft_steps}_rl{args.steps}"
    started = time.perf_counter()
    _run([f"trainer.sft_steps={args.student_sft_steps}", f"trainer.rl_steps={args.steps}",
          f"trainer.eval_interval={args.eval_interval}", f"algo.distill.teacher={teacher_dir}",
          f"algo.actor.optim.lr={args.lr}", f"trainer.output_dir={run_dir}", *COMMON, *SETTINGS[name],
          *args.overrides], args.quiet)
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    kl = [r["distill/reverse_kl"] for r in records if r["phase"] == "rl"]
    window = min(WINDOW, max(1, len(kl) // 2))
    rewards = {step - args.student_sft_steps: reward for step, reward in _evaluations(run_dir).items()
               if step >= args.student_sft_steps}
    return {"kl": kl, "kl_first": sum(kl[:window]) / window, "kl_last": sum(kl[-window:]) / window,
            "rewards": rewards, "wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--teacher-sft-steps", type=int, default=40)
    parser.add_argument("--student-sft-steps", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    parser.add_argument("--quiet", action="store_true", help="hide the runs' progress lines")
    parser.add_argument("overrides", nargs="*", help="more polyfsdp-train overrides for the students")
    args = parser.parse_args(argv)
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    teacher_dir, teacher_reward = teacher(args.out, args.teacher_sft_steps, args.quiet)
    results = {name: student(args.out, name, teacher_dir, args) for name in names}
    steps = sorted(set().union(*(r["rewards"] for r in results.values())))
    print(f"\nteacher: {args.teacher_sft_steps} SFT steps, held-out reward {teacher_reward:.3f}; students from "
          f"{args.student_sft_steps} SFT steps, lr {args.lr}, held-out greedy reward at RL step:")
    print("| setting | reverse KL, first -> last 5 steps | " + " | ".join(f"step {s}" for s in steps)
          + " | wall time |")
    print("| --- | --- | " + " | ".join("---" for _ in steps) + " | --- |")
    for name, r in results.items():
        print(f"| `{name}` | {r['kl_first']:.3f} -> {r['kl_last']:.3f} | "
              + " | ".join(f"{r['rewards'].get(s, float('nan')):.3f}" for s in steps) + f" | {r['wall_s']:.0f} s |")
    return {"teacher_reward": teacher_reward, "students": results}


if __name__ == "__main__":
    main()
