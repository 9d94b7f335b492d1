"""Does ``torch.compile`` of the decoder's MLP and norms speed up the real model's update?

Runs one GRPO step of SmolLM2-135M-Instruct (the settings of real_model_step.py: 8 prompts x 8
completions, up to 32 new tokens, fused AdamW) to capture its ``train_batch`` call, then replays
that update over and over, alternating eager and compiled layers (``torch.compile(dynamic=True)``
on each layer's ``mlp``, ``input_layernorm`` and ``post_attention_layernorm``) in one process, so
that both variants see the same machine. Prints each pair (wall and process CPU seconds) and
the medians. The first compiled call, which builds the kernels, is timed apart.

    python benchmarks/real_model_update_compile.py --pairs 6
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import real_model_step as rms  # noqa: E402
from polyfsdp_grpo import PolyfsdpGRPO  # noqa: E402

PARTS = ("mlp", "input_layernorm", "post_attention_layernorm")


def captured_update(runner, prompts) -> tuple:
    """The arguments of the step's one ``train_batch`` call."""
    from polyfsdp.trainer.rollout.row_seeds import RowSeeds

    engine, calls = runner.engine, []
    original = engine.train_batch

    def capture(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    engine.train_batch = capture
    try:
        runner.step(prompts, 1, row_seeds=RowSeeds(0, 0))
    finally:
        del engine.train_batch
    return calls[0]


def use_compiled(layers, compiled: bool) -> None:
    """Point each layer part's ``forward`` at its compiled or its eager version."""
    for layer in layers:
        for name in PARTS:
            part = getattr(layer, name)
            if not hasattr(part, "_eager_forward"):
                part._eager_forward = part.forward
                part._compiled_forward = torch.compile(part.forward, dynamic=True)
            part.forward = part._compiled_forward if compiled else part._eager_forward


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6, help="eager/compiled pairs (order alternates)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default="/tmp/polyfsdp_bench_real")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from polyfsdp.trainer.data.tokenizers import load_tokenizer

    path = rms.real_checkpoint(args.cache)
    prompts, _ = rms.batches(load_tokenizer(path), 8, 1, 0)
    runner = PolyfsdpGRPO(path, 8, 32, lr=rms.LR, optim_kwargs={"impl": "fused"}, reward=rms.arithmetic_reward)
    call_args, call_kwargs = captured_update(runner, prompts[0])
    layers = runner.engine.module.model.layers

    def update() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        runner.engine.train_batch(*call_args, **call_kwargs)
        return time.perf_counter() - wall, time.process_time() - cpu

    use_compiled(layers, True)
    print(f"first compiled update (builds the kernels): {update()[0]:.1f} s", flush=True)
    times = {False: [], True: []}
    for pair in range(args.pairs):
        for compiled in ((False, True) if pair % 2 == 0 else (True, False)):
            use_compiled(layers, compiled)
            times[compiled].append(update())
        (ew, ec), (cw, cc) = times[False][-1], times[True][-1]
        print(f"pair {pair}: eager {ew:.2f} s ({ec:.2f} s CPU), compiled {cw:.2f} s ({cc:.2f} s CPU)", flush=True)
    for label, i in (("wall", 0), ("CPU", 1)):
        eager = statistics.median(t[i] for t in times[False])
        compiled = statistics.median(t[i] for t in times[True])
        print(f"median {label}: eager {eager:.2f} s, compiled {compiled:.2f} s, compiled/eager {compiled / eager:.3f}")


if __name__ == "__main__":
    main()
