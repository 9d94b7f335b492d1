"""Measured CPU memory of a training step beside engines/memory.py's estimate, with and
without LoRA (and with/without activation checkpointing, fused head).

Each case runs in a fresh child process with glibc's mmap threshold fixed, so every large
tensor is its own mapping and freeing it returns the memory (RSS then follows the live
tensors). The child takes one warm-up step, resets the peak RSS (``/proc/self/clear_refs``),
runs ``forward_backward`` on one micro-batch of ``--tokens`` tokens and reports the rise of
the peak over the RSS before it: activations, gradients, logits and FSDP2's gathered
copies. Usage: ``python benchmarks/memory_table.py [--tokens 2048] [--preset qwen2-small]``.
``run_vlm_case`` does the same for a vision-language model's step with images (the tower's rows).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = (  # (name, lora rank, gradient checkpointing, fused head)
    ("full", 0, False, False),
    ("full, checkpointed", 0, True, False),
    ("full, fused head", 0, False, True),
    ("lora r=8", 8, False, False),
    ("lora r=8, checkpointed", 8, True, False),
)
MIB = 2 ** 20


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_rise(work):
    """``(work(), bytes)``: what ``work`` returns and how far this process's peak RSS rose above
    its RSS just before it (Linux /proc: the peak is reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _rss_kib("VmRSS")
    result = work()
    return result, (_rss_kib("VmHWM") - before) * 1024


def child(preset: str, tokens: int, rank: int, checkpointing: bool, fused: bool) -> dict:
    """One case, in this process: measured step rise and the estimate's rows (bytes)."""
    import torch
    from tensordict import TensorDict

    from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig, SFTLoss
    from polyfsdp.engines.config import LoraConfig
    from polyfsdp.engines.jagged import make_jagged
    from polyfsdp.engines.memory import estimate_memory

    torch.set_num_threads(1)
    model_config = ModelConfig(preset=preset, lora=LoraConfig(rank=rank))
    engine_config = EngineConfig(gradient_checkpointing=checkpointing, use_fused_kernels=fused)
    engine = FSDPEngine(model_config, engine_config, OptimConfig(lr=1e-4)).initialize()
    vocab = engine.module.get_input_embeddings().num_embeddings
    lengths = [tokens // 4] * 4
    offsets = torch.tensor([0] + lengths).cumsum(0)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(tokens)
    batch = TensorDict({"input_ids": make_jagged(ids, offsets), "response_mask": make_jagged(mask, offsets)},
                       batch_size=[4])
    engine.train_batch(batch, SFTLoss())  # warm-up: optimizer state exists, gradients are None again
    _, rise = peak_rss_rise(lambda: engine.forward_backward(batch, SFTLoss()))
    estimate = estimate_memory(model_config, engine_config, world_size=1, tokens=tokens, host_backend=True,
                               entropy=False)  # SFTLoss needs no entropy
    return {"measured_rise": rise, "rows": estimate.rows}


def vlm_child(preset: str, images: int, freeze: bool) -> dict:
    """A vision-language case, in this process: 4 sequences sharing ``images`` 112x112 images
    (8x8 patches, 16 image tokens each) beside 64 text tokens each; the measured step rise and
    the estimate's rows for its tokens and patches."""
    import torch
    from tensordict import TensorDict

    from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig, SFTLoss
    from polyfsdp.engines.jagged import make_jagged
    from polyfsdp.engines.memory import estimate_memory
    from polyfsdp.engines.presets import VLM_TOKENS

    torch.set_num_threads(1)
    model_config, engine_config = ModelConfig(preset=preset, freeze_vision=freeze), EngineConfig()
    engine = FSDPEngine(model_config, engine_config, OptimConfig(lr=1e-4)).initialize()
    g = torch.Generator().manual_seed(0)
    image = [VLM_TOKENS["vision_start_token_id"], *[VLM_TOKENS["image_token_id"]] * 16, VLM_TOKENS["vision_end_token_id"]]
    per_seq = [images // 4 + (i < images % 4) for i in range(4)]
    ids = [torch.tensor(image * k + torch.randint(0, 120, (64,), generator=g).tolist()) for k in per_seq]
    pixels = [torch.randn(64 * k, 1176, generator=g) for k in per_seq]
    grids = [torch.tensor([[1, 8, 8]] * k, dtype=torch.long).reshape(k, 3) for k in per_seq]

    def jagged(parts):
        return make_jagged(torch.cat(parts), torch.tensor([0] + [len(p) for p in parts]).cumsum(0))

    batch = TensorDict({"input_ids": jagged(ids), "response_mask": jagged([torch.ones(len(i)) for i in ids]),
                        "pixel_values": jagged(pixels), "image_grid_thw": jagged(grids)}, batch_size=[4])
    engine.train_batch(batch, SFTLoss())  # warm-up
    _, rise = peak_rss_rise(lambda: engine.forward_backward(batch, SFTLoss()))
    tokens, patches = sum(len(i) for i in ids), 64 * images
    estimate = estimate_memory(model_config, engine_config, world_size=1, tokens=tokens, host_backend=True,
                               entropy=False, patches=patches)
    return {"measured_rise": rise, "rows": estimate.rows, "tokens": tokens, "patches": patches}


def run_vlm_case(preset: str, images: int, freeze: bool) -> dict:
    """:func:`vlm_child` in a fresh child process (as :func:`run_case`)."""
    return _run_child(["--vlm-child", json.dumps([preset, images, freeze])])


def run_case(preset: str, tokens: int, rank: int, checkpointing: bool, fused: bool) -> dict:
    """Run one case in a fresh child process (see the module docstring)."""
    return _run_child(["--child", json.dumps([preset, tokens, rank, checkpointing, fused])])


def _run_child(args: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    command = [sys.executable, __file__, *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_estimate(rows: dict) -> int:
    """What the measured rise holds, from the estimate: activations and head as configured,
    and the gradients."""
    return rows["step activations + head (as configured)"] + rows["gradients (trainable only)"]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen2-small")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--child", default=None)
    parser.add_argument("--vlm-child", default=None)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(*json.loads(args.child))))
        return []
    if args.vlm_child is not None:
        print(json.dumps(vlm_child(*json.loads(args.vlm_child))))
        return []
    print(f"{args.preset}, {args.tokens} tokens in one micro-batch, 1 rank, fp32, CPU; MiB")
    print(f"{'case':<24} {'params':>8} {'grads':>8} {'adam':>8} {'step rise measured':>19} "
          f"{'estimated':>10} {'est/meas':>9}")
    results = []
    for name, rank, checkpointing, fused in CASES:
        out = run_case(args.preset, args.tokens, rank, checkpointing, fused)
        rows = out["rows"]
        estimated = step_estimate(rows)
        ratio = estimated / out["measured_rise"]
        results.append({"case": name, "ratio": ratio, **out})
        print(f"{name:<24} {rows['parameters (sharded, master dtype)'] / MIB:>8.2f} "
              f"{rows['gradients (trainable only)'] / MIB:>8.2f} "
              f"{rows['optimizer state (AdamW, trainable only)'] / MIB:>8.2f} "
              f"{out['measured_rise'] / MIB:>19.1f} {estimated / MIB:>10.1f} {ratio:>9.2f}")
    return results


if __name__ == "__main__":
    main()
