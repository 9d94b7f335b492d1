"""The compute floor of a GRPO step on this machine, for a Llama-shaped model (the real-model
benchmark, benchmarks/real_model_step.py): a short calibration of the GEMM rate at the model's
own shapes and of the memory bandwidth, and from it each phase's floor.

* Large-M GEMMs (update, old log-probs, prefill): one layer's seven projections and the LM head,
  forward ``x @ W^T``, backward-input ``g @ W`` and backward-weight ``g^T @ x``, at ``LARGE_M``
  rows (the head: the faster of ``LARGE_M`` and ``HEAD_CHUNK`` rows), scaled linearly to the
  step's token count (the rate is flat at that size). Each is the best of a few repeats.
* Decode GEMMs: every projection of every layer plus the head, each a distinct weight (so the
  weights stream from memory as in a real decoding step, 0.5 GB in fp32), at M = live rows.
* Bandwidth: the read rate of a ``BW_BYTES`` fp32 tensor (``sum``).

Floors (seconds): the update is forward + backward GEMMs over every token (6 x params x tokens,
the head over every position as the issue counts it; also shown with the head over completion
positions only, what ``logits_to_keep`` would leave) plus causal attention at the forward rate
plus one AdamW pass over params, grads and both moments at the measured bandwidth; a no-grad
pass (old log-probs, reference) is the forward GEMMs; generation is the prefill (forward GEMMs
over the prompt tokens, head on the last position) plus, per decoding step with M live rows,
``max(GEMMs at M, weight bytes / bandwidth)``.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

LARGE_M = 2048
HEAD_CHUNK = 256
DECODE_M = (1, 2, 4, 8, 16, 32, 64)
BW_BYTES = 512 * 2 ** 20


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def _best(fn, reps: int) -> float:
    """Least wall seconds of ``reps`` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _gemm_times(k: int, n: int, m: int, reps: int) -> tuple[float, float, float]:
    """Seconds of forward, backward-input and backward-weight GEMMs of a (k -> n) linear over m rows."""
    x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    fwd = _best(lambda: F.linear(x, w), reps)
    bwd_in = _best(lambda: torch.mm(g, w), reps)
    bwd_w = _best(lambda: torch.mm(g.t(), x), reps)
    return fwd, bwd_in, bwd_w


def calibrate(cfg, reps: int = 3) -> dict:
    """The measured rates: per-token seconds of the body's and the head's forward / backward GEMMs,
    decode-step GEMM seconds per M, and the read bandwidth (bytes/s)."""
    layers = cfg.num_hidden_layers
    with torch.inference_mode():
        body = [0.0, 0.0, 0.0]
        for k, n in layer_shapes(cfg):
            for i, t in enumerate(_gemm_times(k, n, LARGE_M, reps)):
                body[i] += layers * t / LARGE_M
        # The head's (M, 49152) output makes the rate depend on M: the better of a whole batch and a chunk.
        head = [min(a / LARGE_M, b / HEAD_CHUNK) for a, b in
                zip(_gemm_times(cfg.hidden_size, cfg.vocab_size, LARGE_M, max(1, reps - 1)),
                    _gemm_times(cfg.hidden_size, cfg.vocab_size, HEAD_CHUNK, reps))]
        weights = [torch.randn(n, k) for _ in range(layers) for k, n in layer_shapes(cfg)]
        head_w = torch.randn(cfg.vocab_size, cfg.hidden_size)
        decode = {}
        for m in DECODE_M:
            xs = {k: torch.randn(m, k) for k, _ in layer_shapes(cfg)}

            def step():
                for w in weights:
                    F.linear(xs[w.shape[1]], w)
                F.linear(xs[cfg.hidden_size], head_w)
            decode[m] = _best(step, reps)
        weights.clear()  # free the copies (the closure above is done with them)
        buf = torch.ones(BW_BYTES // 4)
        bandwidth = BW_BYTES / _best(lambda: buf.sum(), reps)
    body_params = layers * sum(k * n for k, n in layer_shapes(cfg))
    head_params = cfg.hidden_size * cfg.vocab_size
    return {"body_fwd": body[0], "body_bwd_in": body[1], "body_bwd_w": body[2], "head_fwd": head[0],
            "head_bwd_in": head[1], "head_bwd_w": head[2], "decode": decode, "bandwidth": bandwidth,
            "body_params": body_params, "head_params": head_params, "hidden": cfg.hidden_size, "layers": layers}


def best_of(*cals: dict) -> dict:
    """Per entry the fastest of several calibrations (a floor is the best the machine did; other
    work on the cores only slows a calibration down)."""
    out = dict(cals[0])
    for key in ("body_fwd", "body_bwd_in", "body_bwd_w", "head_fwd", "head_bwd_in", "head_bwd_w"):
        out[key] = min(c[key] for c in cals)
    out["decode"] = {m: min(c["decode"][m] for c in cals) for m in cals[0]["decode"]}
    out["bandwidth"] = max(c["bandwidth"] for c in cals)
    return out


def decode_gemm_s(cal: dict, m: int) -> float:
    """Decode-step GEMM seconds at ``m`` rows, linear between the measured M."""
    ms = sorted(cal["decode"])
    if m in cal["decode"]:
        return cal["decode"][m]
    lo = max((x for x in ms if x < m), default=ms[0])
    hi = min((x for x in ms if x > m), default=ms[-1])
    if hi == lo:
        return cal["decode"][lo] * m / lo
    return cal["decode"][lo] + (cal["decode"][hi] - cal["decode"][lo]) * (m - lo) / (hi - lo)


def rates(cal: dict) -> list[tuple[str, float]]:
    """(what, GFLOP/s or GB/s) lines of the calibration."""
    b, h = cal["body_params"], cal["head_params"]
    out = [("GEMM forward, large M (body / head)", 2 * b / cal["body_fwd"] / 1e9),
           ("GEMM forward, head 576x49152", 2 * h / cal["head_fwd"] / 1e9),
           ("GEMM backward-input (body)", 2 * b / cal["body_bwd_in"] / 1e9),
           ("GEMM backward-weight (body)", 2 * b / cal["body_bwd_w"] / 1e9),
           ("GEMM backward (head, input + weight)", 4 * h / (cal["head_bwd_in"] + cal["head_bwd_w"]) / 1e9)]
    for m, t in sorted(cal["decode"].items()):
        out.append((f"decode step GEMMs, M={m} (all layers + head)", 2 * (b + h) * m / t / 1e9))
    out.append(("memory read bandwidth (GB/s)", cal["bandwidth"] / 1e9))
    return out


def _attention_flops(cal: dict, lengths: list[int], backward: bool) -> float:
    """Causal attention FLOPs (QK^T and AV) over sequences of ``lengths``."""
    fwd = 2 * cal["hidden"] * sum(n * n for n in lengths) * cal["layers"]  # 2 GEMMs x 2 FLOP x n^2/2 x hidden
    return fwd * (3 if backward else 1)


def forward_floor(cal: dict, tokens: int, head_tokens: int | None = None) -> float:
    """A no-grad pass: the forward GEMMs over ``tokens`` (the head over ``head_tokens``, default all)."""
    head_tokens = tokens if head_tokens is None else head_tokens
    return cal["body_fwd"] * tokens + cal["head_fwd"] * head_tokens


def update_floor(cal: dict, lengths: list[int], head_tokens: int | None = None) -> dict:
    """Forward + backward over sequences of ``lengths`` (the head over ``head_tokens``, default
    every token) and one AdamW step; seconds per part and in all."""
    tokens = sum(lengths)
    head_tokens = tokens if head_tokens is None else head_tokens
    gemm = ((cal["body_fwd"] + cal["body_bwd_in"] + cal["body_bwd_w"]) * tokens
            + (cal["head_fwd"] + cal["head_bwd_in"] + cal["head_bwd_w"]) * head_tokens)
    attn = _attention_flops(cal, lengths, True) / (2 * cal["body_params"] / cal["body_fwd"])
    params = cal["body_params"] + cal["head_params"]
    adamw = 7 * 4 * params / cal["bandwidth"]  # read p, g, m, v; write p, m, v (fp32)
    return {"gemm": gemm, "attention": attn, "adamw": adamw, "total": gemm + attn + adamw}


def generation_floor(cal: dict, prompt_lengths: list[int], completion_lengths: list[int], group: int = 1) -> dict:
    """Prefill plus one decoding step per further token, each at its live-row count. ``group``:
    consecutive rows that share a prompt, which is prefilled once (trainer/rollout/decode.py)."""
    distinct = prompt_lengths[::group]
    prefill = cal["body_fwd"] * sum(distinct) + cal["head_fwd"] * len(distinct) \
        + _attention_flops(cal, distinct, False) / (2 * cal["body_params"] / cal["body_fwd"])
    weight_read = 4 * (cal["body_params"] + cal["head_params"]) / cal["bandwidth"]
    compute = reads = steps = 0.0
    decode = 0.0
    for s in range(1, max(completion_lengths, default=0)):
        live = sum(1 for n in completion_lengths if n > s)
        c = decode_gemm_s(cal, live)
        compute, reads, steps = compute + c, reads + weight_read, steps + 1
        decode += max(c, weight_read)
    tokens = sum(completion_lengths)
    flops = 2 * (cal["body_params"] + cal["head_params"]) * tokens
    return {"prefill": prefill, "decode_compute": compute, "decode_reads": reads, "decode": decode,
            "steps": steps, "total": prefill + decode, "tokens": tokens, "flops": flops}


def phase_table(rows: list[tuple[str, float | None, float | None]]) -> str:
    """``phase | measured s | floor s | x floor`` lines."""
    lines = [f"| {'phase':<44} | {'measured s':>10} | {'floor s':>8} | {'x floor':>7} |",
             f"| {'-' * 44} | {'-' * 10} | {'-' * 8} | {'-' * 7} |"]
    for name, measured, floor in rows:
        m = f"{measured:.2f}" if measured is not None else "-"
        f = f"{floor:.2f}" if floor is not None else "-"
        x = f"{measured / floor:.2f}" if measured is not None and floor else "-"
        lines.append(f"| {name:<44} | {m:>10} | {f:>8} | {x:>7} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a Hugging Face model directory (its config.json)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    c = calibrate(AutoConfig.from_pretrained(args.path))
    for what, v in rates(c):
        print(f"{what:<48} {v:8.1f}")
