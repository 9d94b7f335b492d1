"""The LM head only where it is read (engines/head/rows.py), side by side with the whole head.

A model of SmolLM2-135M-Instruct's shapes (Llama, hidden 576, 9 heads / 3 KV heads, MLP 1536,
vocabulary 49,152, tied embeddings; ``--layers`` of its 30, random weights: the FLOPs are the
same) on an RL batch of issue 43's shape: 8 prompts x 8 completions, prompts of 30-45 tokens,
completions of 8-32. Two passes, each timed with the head on the response positions only and on
every position, interleaved per round (the order alternates), medians over rounds:

- ``old-log-prob``: ``infer_batch(mask_field="response_mask")`` against ``infer_batch``;
- ``ppo-step``: ``train_batch`` with ``PPOLoss`` (declares ``masked_positions_only``) against the
  same loss opted out (``masked_positions_only = False``).

Prints seconds and the ratio narrow/whole per pass and the head's share of the forward FLOPs.

    python benchmarks/head_rows.py                  # 30 layers, 3 rounds (about 5 min on 2 cores)
    python benchmarks/head_rows.py --layers 4 --rounds 1 --quick
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from tensordict import TensorDict

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig, PPOLoss, make_jagged

HIDDEN, HEADS, KV_HEADS, MLP, VOCAB = 576, 9, 3, 1536, 49152


def checkpoint(layers: int, directory: str) -> str:
    """A random-weight checkpoint of SmolLM2-135M's shapes with ``layers`` decoder layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, num_hidden_layers=layers, vocab_size=VOCAB,
                         tie_word_embeddings=True, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def rl_batch(prompts: int, group: int, seed: int = 0) -> tuple[TensorDict, int, int]:
    """An RL batch of ``prompts x group`` sequences: ``(batch, tokens, response tokens)``."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(prompts):
        prompt = int(torch.randint(30, 46, (1,), generator=g))
        for _ in range(group):
            response = int(torch.randint(8, 33, (1,), generator=g))
            ids.append(torch.randint(0, VOCAB, (prompt + response,), generator=g))
            mask = torch.zeros(prompt + response)
            mask[prompt - 1: prompt + response - 1] = 1.0
            masks.append(mask)
    offsets = torch.tensor([0] + [len(x) for x in ids]).cumsum(0)
    values = torch.cat(masks)
    batch = TensorDict({"input_ids": make_jagged(torch.cat(ids), offsets), "response_mask": make_jagged(values, offsets),
                        "old_log_probs": make_jagged(torch.full_like(values, -10.0), offsets),
                        "advantages": make_jagged(torch.randn(values.shape[0], generator=g), offsets)},
                       batch_size=[len(ids)])
    return batch, int(offsets[-1]), int(values.sum())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 prompts x 4: a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts, group = (2, 4) if args.quick else (8, 8)
    batch, tokens, response = rl_batch(prompts, group)
    with tempfile.TemporaryDirectory() as tmp:
        engine = FSDPEngine(ModelConfig(path=checkpoint(args.layers, tmp)), EngineConfig(),
                            OptimConfig(lr=1e-6)).initialize()
    whole_loss = PPOLoss()
    whole_loss.masked_positions_only = False
    passes = {
        "old-log-prob": (lambda: engine.infer_batch(batch, calculate_entropy=False, mask_field="response_mask"),
                         lambda: engine.infer_batch(batch, calculate_entropy=False)),
        "ppo-step": (lambda: engine.train_batch(batch, PPOLoss()), lambda: engine.train_batch(batch, whole_loss)),
    }
    for narrow, whole in passes.values():  # warm-up: one-time work
        narrow(), whole()
    times = {name: {"narrow": [], "whole": []} for name in passes}
    for r in range(args.rounds):
        for name, (narrow, whole) in passes.items():
            order = [("narrow", narrow), ("whole", whole)]
            for label, fn in (order if r % 2 == 0 else order[::-1]):
                times[name][label].append(timed(fn))
    body = args.layers * (HIDDEN * HIDDEN * (2 + 2 * KV_HEADS / HEADS) + 3 * HIDDEN * MLP)
    print(f"model: SmolLM2-135M shapes, {args.layers} layers; batch {prompts}x{group}: {tokens} tokens, "
          f"{response} response ({response / tokens:.0%}); head {HIDDEN * VOCAB / (HIDDEN * VOCAB + body):.0%} of the "
          f"forward's matmul FLOPs; {args.threads} threads, {args.rounds} rounds")
    print(f"{'pass':<14}{'response only (s)':>18}{'every position (s)':>20}{'ratio':>8}")
    for name, row in times.items():
        narrow, whole = statistics.median(row["narrow"]), statistics.median(row["whole"])
        print(f"{name:<14}{narrow:>18.2f}{whole:>20.2f}{narrow / whole:>8.2f}")


if __name__ == "__main__":
    main()
