"""Where the built-in decoding loop's time goes on the real model (SmolLM2-135M-Instruct, the
rollout of benchmarks/real_model_step.py: 8 prompts x 8 completions, 32 new tokens, per-row seeds
as the trainer passes them), measured three ways:

* wall seconds of ``generate`` (trainer/rollout/generate.py -> decode.py), plain, median of repeats;
* an exclusive-time breakdown from wrappers put (in this process only) around the model's parts:
  LM head, MLP, attention projections, the SDPA call, the KV-cache write, RoPE, RMSNorm, the rest of
  the model forward, the next-token choice (shaping, the per-row Gumbel draw, log-probs) and the
  loop's own Python (what is left of the wall time), split into prefill and decoding steps;
* torch.profiler's op table (self CPU time, grouped by input shapes) over one ``generate``;
* the prefill over all rows against over each distinct prompt once (a group's 8 rows share it).

The floor of the same rollout (benchmarks/real_model_floor.py) is printed beside it.

    python benchmarks/real_model_decode_profile.py               # converts the GGUF once, as real_model_step.py
    python benchmarks/real_model_decode_profile.py --rows 25
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import real_model_floor as floor  # noqa: E402


class Sections:
    """Exclusive wall seconds per named section (nested sections are subtracted from their parent)."""

    def __init__(self) -> None:
        self.exclusive: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []
        self.forwards = 0

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            label = name(self) if callable(name) else name
            frame = [label, 0.0]
            self.stack.append(frame)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.stack.pop()
                self.exclusive[label] = self.exclusive.get(label, 0.0) + dt - frame[1]
                self.calls[label] = self.calls.get(label, 0) + 1
                if self.stack:
                    self.stack[-1][1] += dt
        return timed


@contextmanager
def patched(owner, attr: str, value):
    """``owner.attr = value`` for the block (an attribute the owner only inherited is deleted after)."""
    own = attr in vars(owner)
    saved = vars(owner).get(attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, attr, saved)
        else:
            delattr(owner, attr)


@contextmanager
def sectioned(model, sec: Sections):
    """Wrap the model's parts and the loop's next-token choice with ``sec``'s timers."""
    from transformers import AttentionInterface
    from transformers.models.llama import modeling_llama as ml

    from polyfsdp.trainer.rollout import decode as decode_mod
    from polyfsdp.trainer.rollout.decode import _PreallocatedLayer
    from polyfsdp.trainer.rollout.row_sampler import RowSampler

    attn_name = model.config._attn_implementation
    attn_fn = AttentionInterface._global_mapping[attn_name]
    phase = lambda s: "prefill" if s.forwards == 1 else "decode"  # noqa: E731
    model_forward = model.forward

    def counted_forward(*args, **kwargs):
        sec.forwards += 1
        return model_forward(*args, **kwargs)
    parts = [(ml.LlamaMLP, "forward", "MLP (gate/up/down GEMMs, SiLU)"),
             (ml.LlamaAttention, "forward", "attention: q/k/v/o projections and reshapes"),
             (ml.LlamaRMSNorm, "forward", "RMSNorm"),
             (ml.LlamaDecoderLayer, "forward", "decoder layer glue (residual adds)"),
             (ml.LlamaRotaryEmbedding, "forward", "RoPE cos/sin"),
             (_PreallocatedLayer, "update", "KV cache write"),
             (RowSampler, "draw", "next token: per-row Gumbel draw")]
    with ExitStack() as stack:
        stack.enter_context(patched(model, "forward", sec.wrap(lambda s: f"{phase(s)}: model forward (rest)",
                                                               counted_forward)))
        stack.enter_context(patched(model.lm_head, "forward", sec.wrap("LM head (576 x 49152)", model.lm_head.forward)))
        for owner, attr, label in parts:
            stack.enter_context(patched(owner, attr, sec.wrap(label, getattr(owner, attr))))
        stack.enter_context(patched(ml, "apply_rotary_pos_emb", sec.wrap("RoPE apply", ml.apply_rotary_pos_emb)))
        stack.enter_context(patched(decode_mod, "_next_tokens", sec.wrap("next token: shaping, log-probs",
                                                                         decode_mod._next_tokens)))
        AttentionInterface.register(attn_name, sec.wrap("attention: SDPA over the cache", attn_fn))
        stack.callback(AttentionInterface.register, attn_name, attn_fn)
        yield


def prefill_sharing(engine, prompts: list[list[int]], group: int, new_tokens: int, pad: int, reps: int = 3) -> dict:
    """The decoding loop's prefill (trainer/rollout/decode.py: every row, logits of the last
    position) over all rows, against over each distinct prompt once with its cache rows then
    repeated ``group`` times (what a group's identical prompts allow): best seconds of each,
    and the largest difference of their last-position logits."""
    from polyfsdp.trainer.rollout import decode as decode_mod
    from polyfsdp.trainer.rollout.generate import _left_padded

    model = engine.module
    ids, mask = _left_padded(prompts, pad)
    capacity = ids.shape[1] + new_tokens

    def prefill(ids, mask):
        cache = decode_mod._preallocated_cache(model, capacity)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **{decode_mod._cache_keyword(model): cache})
        return cache, out.logits

    def shared():
        cache, logits = prefill(ids[::group], mask[::group])
        index = torch.arange(ids.shape[0] // group).repeat_interleave(group)
        cache.batch_select_indices(index)
        return cache, logits[index]

    times = {}
    with engine.eval_mode(), torch.inference_mode():
        for name, fn in (("all rows", lambda: prefill(ids, mask)), ("distinct prompts", shared)):
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                _, logits = fn()
                best = min(best, time.perf_counter() - t)
            times[name] = (best, logits)
    diff = (times["all rows"][1] - times["distinct prompts"][1]).abs().max().item()
    return {"all": times["all rows"][0], "shared": times["distinct prompts"][0], "max_logit_diff": diff}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=None, help="the converted HF directory (default: convert the GGUF)")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "polyfsdp_bench_real"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15, help="rows of the profiler's op table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
    from polyfsdp.trainer.data.tokenizers import load_tokenizer
    from polyfsdp.trainer.rollout import generate as gen_mod
    from polyfsdp.trainer.rollout.engines import SamplingParams
    from polyfsdp.trainer.rollout.row_seeds import RowSeeds
    import real_model_step

    path = args.path or real_model_step.real_checkpoint(args.cache)
    tokenizer = load_tokenizer(path)
    engine = FSDPEngine(ModelConfig(path=path), EngineConfig(), OptimConfig()).initialize()
    model = engine.module
    batch = real_model_step.batches(tokenizer, args.prompts, 1, 0)[0][0]
    prompts = [list(p["prompt_ids"]) for p in batch for _ in range(args.group)]
    params = SamplingParams.for_tokenizer(tokenizer, args.new_tokens, temperature=1.0)
    seeds = RowSeeds(0, 0).rows(0, args.prompts, args.group)
    lengths: list[int] = []

    def rollout():
        torch.manual_seed(0)
        out = gen_mod.generate(engine, prompts, params, row_seeds=seeds)
        lengths[:] = [len(c) for c in out.token_ids]

    rollout()  # warm-up
    walls = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        rollout()
        walls.append(time.perf_counter() - t)
    wall = statistics.median(walls)
    share = prefill_sharing(engine, prompts, args.group, args.new_tokens, params.pad_token_id)
    sec = Sections()
    with sectioned(model, sec):
        t = time.perf_counter()
        rollout()
        sec_wall = time.perf_counter() - t
    cal = floor.calibrate(AutoConfig.from_pretrained(path))
    fl = floor.generation_floor(cal, [len(p) for p in prompts], lengths)
    print(f"\ngeneration profile: {len(prompts)} rows, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {sum(lengths)} new tokens (max {max(lengths)}, {sum(n == args.new_tokens for n in lengths)} "
          f"rows cut at {args.new_tokens}), {sec.forwards} forwards, threads={args.threads}")
    print(f"wall (median of {args.repeats}): {wall:.2f} s = {sum(lengths) / wall:.0f} tokens/s, "
          f"{2 * (cal['body_params'] + cal['head_params']) * sum(lengths) / wall / 1e9:.1f} GFLOP/s of decode FLOPs; "
          f"floor {fl['total']:.2f} s (prefill {fl['prefill']:.2f}, decode GEMMs {fl['decode_compute']:.2f}, "
          f"weight reads {fl['decode_reads']:.2f}): {wall / fl['total']:.2f}x floor")
    print(f"prefill: all {len(prompts)} rows {share['all']:.2f} s; the {len(prompts) // args.group} distinct prompts "
          f"once, cache rows repeated x{args.group}: {share['shared']:.2f} s (saves {share['all'] - share['shared']:.2f}"
          f" s a rollout; last-position logits differ by at most {share['max_logit_diff']:.1e})")
    accounted = sum(sec.exclusive.values())
    rest = sec_wall - accounted
    print(f"\nbreakdown (one sectioned run: {sec_wall:.2f} s; wrappers add about {sec_wall - wall:+.2f} s)")
    print(f"| {'part':<48} | {'s':>6} | {'%':>5} | {'calls':>6} |")
    print(f"| {'-' * 48} | {'-' * 6} | {'-' * 5} | {'-' * 6} |")
    for name, s in sorted(sec.exclusive.items(), key=lambda kv: -kv[1]):
        print(f"| {name:<48} | {s:6.2f} | {100 * s / sec_wall:5.1f} | {sec.calls[name]:>6} |")
    print(f"| {'decoding loop outside the model (Python, cache select)':<48} | {rest:6.2f} | "
          f"{100 * rest / sec_wall:5.1f} | {'':>6} |")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        rollout()
    print("\ntorch.profiler, one generate (self CPU time, by op and input shapes; profiler overhead included):")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                             max_name_column_width=40, max_shapes_column_width=60))
    return {"wall": wall, "floor": fl, "sections": dict(sec.exclusive), "rest": rest, "prefill": share}


if __name__ == "__main__":
    main()
