"""Child process for test_resume.py: a short GRPO-style run of FSDPEngine.

Modes: ``full`` trains every step without checkpoints; ``kill`` saves a checkpoint after
step ``--save-at``, prints a marker, keeps training and then blocks (only SIGKILL ends it);
``resume`` loads the latest checkpoint and trains the remaining steps. ``full`` and
``resume`` write the loss curve and the final parameters to ``--out``.

Data is keyed by step; a noise term drawn from the global torch and Python RNGs stands in
for sampling/dropout, so a resume that failed to restore RNG state would diverge.
"""
import argparse
import random
import sys

import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import PPOLoss

MARKER = "CHECKPOINT_SAVED"
VOCAB = 128


def jagged(parts):
    lengths = torch.tensor([len(p) for p in parts])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets, min_seqlen=int(lengths.min()),
                                                  max_seqlen=int(lengths.max()))


def batch_for(step):
    """Sequences, response masks and base advantages determined by ``step`` alone."""
    g = torch.Generator().manual_seed(10_000 + step)
    lengths = torch.randint(3, 12, (6,), generator=g).tolist()
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    masks = []
    for n in lengths:
        m = torch.zeros(n)
        m[n // 3: n - 1] = 1.0
        masks.append(m)
    advantages = torch.randn(len(lengths), generator=g)
    return seqs, masks, advantages


def train_step(engine, loss_fn, step):
    seqs, masks, advantages = batch_for(step)
    advantages = advantages + 0.1 * torch.randn(len(seqs)) + 0.01 * random.random()
    batch = TensorDict({"input_ids": jagged(seqs), "response_mask": jagged(masks)}, batch_size=[len(seqs)])
    old = engine.infer_batch(batch, calculate_entropy=False)["log_probs"]
    batch["old_log_probs"] = old
    batch["advantages"] = jagged([torch.full((len(s),), float(a)) for s, a in zip(seqs, advantages)])
    return engine.train_batch(batch, loss_fn)["loss"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("full", "kill", "resume"), required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int, required=True)
    parser.add_argument("--out")
    args = parser.parse_args()

    engine = FSDPEngine(
        ModelConfig(preset="qwen2-tiny", seed=3),
        EngineConfig(max_tokens_per_micro_batch=24),
        OptimConfig(lr=5e-3, weight_decay=0.01, grad_clip=1.0, lr_scheduler="warmup_cosine",
                    warmup_steps=2, total_steps=args.steps),
    ).initialize()
    loss_fn = PPOLoss(clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coef=0.01)
    torch.manual_seed(1234)
    random.seed(1234)

    start = 0
    if args.mode == "resume":
        start, extra = engine.load_checkpoint(args.ckpt)
        if extra != {"next_step": start}:
            raise SystemExit(f"unexpected extra {extra!r} for step {start}")
    losses = []
    for step in range(start, args.steps):
        loss = train_step(engine, loss_fn, step)
        losses.append(loss)
        print(f"step={step} loss={loss!r}", flush=True)
        if args.mode == "kill" and engine.global_step == args.save_at:
            engine.save_checkpoint(args.ckpt, extra={"next_step": engine.global_step})
            print(f"{MARKER} {engine.global_step}", flush=True)
    if args.mode == "kill":
        sys.stdin.read()  # never returns: the parent holds stdin open and kills this process
        raise SystemExit("stdin closed before the kill")
    params = {}
    for name, value in engine.module.state_dict().items():
        params[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    torch.save({"start": start, "losses": losses, "params": params}, args.out)


if __name__ == "__main__":
    main()
