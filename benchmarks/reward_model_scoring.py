"""Reward-model scoring against the policy's forward, side by side in one process.

1. Throughput: the same rows (``--rows`` x ``--length`` random tokens) through a policy engine's
   ``infer_batch`` (log-probs, the old-log-prob pass) and a reward model's ``infer_scores``, both
   the ``qwen2-small`` preset, in interleaved rounds; prints tokens/s of each (process CPU time,
   medians) and their ratio. The ratio is the number to read; the times depend on the machine.
2. Share of the step: a short GRPO job at the small preset with ``reward.model`` (a qwen2-small
   classifier for the job's tokenizer) times every reward-model ``score_all`` call and prints its
   share of the RL steps' ``step_time_s``.

    python benchmarks/reward_model_scoring.py [--rows 32 --length 256 --rounds 3 --steps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from tensordict import TensorDict

from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.jagged import make_jagged

PRESET = "qwen2-small"


def _batch(rows: int, length: int, vocab: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows * length,), generator=g)
    offsets = torch.arange(0, rows * length + 1, length)
    return TensorDict({"input_ids": make_jagged(ids, offsets)}, batch_size=[rows])


def throughput(rows: int, length: int, rounds: int) -> None:
    policy = FSDPEngine(ModelConfig(preset=PRESET), EngineConfig()).initialize()
    reward = FSDPEngine(ModelConfig(preset=PRESET, score_head=True), EngineConfig()).initialize()
    batch = _batch(rows, length, policy.module.config.vocab_size)
    times = {"policy log-probs": [], "reward model scores": []}
    calls = {"policy log-probs": lambda: policy.infer_batch(batch, calculate_entropy=False),
             "reward model scores": lambda: reward.infer_scores(batch)}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.process_time()
            call()
            times[name].append(time.process_time() - start)
    tokens = rows * length
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    for name, rate in rates.items():
        print(f"{name:<22} {rate:>10.0f} tokens/s (CPU time, median of {rounds})")
    print(f"reward model / policy forward throughput: {rates['reward model scores'] / rates['policy log-probs']:.2f}x "
          f"({rows} rows x {length} tokens, {PRESET})")


def step_share(steps: int) -> None:
    from transformers import AutoModelForSequenceClassification

    from polyfsdp.engines.presets import preset_config
    from polyfsdp.trainer.data.tokenizers import CharTokenizer
    from polyfsdp.trainer.rewards import reward_model
    from polyfsdp.trainer.train import main

    spent = []
    score_all = reward_model.RewardModelSource.score_all

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return score_all(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    reward_model.RewardModelSource.score_all = timed
    with tempfile.TemporaryDirectory() as tmp:
        tok = CharTokenizer()
        rm = os.path.join(tmp, "rm")
        config = preset_config(PRESET, vocab_size=tok.vocab_size, num_labels=1, pad_token_id=tok.pad_token_id)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(rm)
        tok.save_pretrained(rm)
        out = os.path.join(tmp, "run")
        code = main([f"model.preset={PRESET}", "~model.overrides", "trainer.sft_steps=0", f"trainer.rl_steps={steps}",
                     "trainer.prompts_per_step=8", "algo.actor.group_size=4", "algo.actor.max_new_tokens=32",
                     "data.eval_size=8", "eval.initial=false", "trainer.progress=off", "trainer.plot=false",
                     "trainer.export=false", "trainer.checkpoint_interval=0", f"reward.model.path={rm}",
                     f"trainer.output_dir={out}"])
        assert code == 0
        records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    step_time = sum(r["step_time_s"] for r in records if r["phase"] == "rl")
    # The last call scores the final evaluation, outside the RL steps.
    in_steps = sum(spent[:steps])
    print(f"GRPO at {PRESET} (8 prompts x 4 completions x <= 32 new tokens, {steps} steps): reward-model scoring "
          f"{in_steps:.2f} s of {step_time:.2f} s of RL steps = {100 * in_steps / step_time:.1f}% of the step")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    throughput(args.rows, args.length, args.rounds)
    step_share(args.steps)
    sys.stdout.flush()
