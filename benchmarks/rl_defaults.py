"""Do the RL defaults hold on tasks they were not tuned on? Writes held-out tasks of a user's
shape (verl-layout JSONL, string prompts, the preset model with its character tokenizer) and runs
``polyfsdp-train`` on each: SFT, then the RL phase with the given overrides; prints the held-out
greedy reward after SFT, its lowest point during RL and at the end.

    python benchmarks/rl_defaults.py --out /tmp/rl_defaults                       # default GRPO
    python benchmarks/rl_defaults.py --out /tmp/rl_defaults --label ppo algo=ppo
    python benchmarks/rl_defaults.py --out /tmp/rl_defaults --label lr algo.actor.optim.lr=1e-4

Tasks: ``sort`` (sort 3-6 letters: ``dbca=`` -> ``abcd``) and ``shift`` (each letter to the next
one of the alphabet, h to a: ``hab=`` -> ``abc``), both scored by ``char_match`` (the fraction of
the right characters in the right places), and ``sort_exact`` (sort, scored 1/0 by ``exact_match``:
a sparse reward).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ALPHABET = "abcdefgh"
TASKS = {
    "sort": (lambda s: "".join(sorted(s)), "char_match"),
    "shift": (lambda s: "".join(ALPHABET[(ALPHABET.index(c) + 1) % len(ALPHABET)] for c in s), "char_match"),
    "sort_exact": (lambda s: "".join(sorted(s)), "exact_match"),
}
# The SFT warm-up leaves these tasks part-solved (like the 30-step warm-up), so RL has room.
BASE_OVERRIDES = ["trainer.sft_steps=30", "trainer.rl_steps=60", "trainer.eval_interval=10",
                  "trainer.checkpoint_interval=0", "trainer.plot=false", "trainer.export=false",
                  "trainer.progress=off", "algo.actor.max_new_tokens=8"]


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_user_model(directory: Path) -> Path:
    """A user's own model directory, as in issue 30: a ~0.1M-parameter Qwen2 from config and a
    byte-level BPE tokenizer trained here on letter strings, with a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    if (directory / "config.json").is_file():
        return directory
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    rng = random.Random(3)
    corpus = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 6))) for _ in range(2000)]
    core.train_from_iterator(corpus + ["user assistant"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def records(task: str, count: int, seed: int, exclude: frozenset = frozenset(),
            chat: bool = False) -> list[dict]:
    rule = TASKS[task][0]
    rng = random.Random(seed)
    rows = []
    while len(rows) < count:
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 6)))
        if word in exclude:
            continue
        index = len(rows)
        prompt = [{"role": "user", "content": f"{task} {word}"}] if chat else word + "="
        rows.append({"data_source": task, "prompt": prompt,
                     "reward_model": {"style": "rule", "ground_truth": rule(word)}, "extra_info": {"index": index}})
    return rows


def write_task(directory: Path, task: str, chat: bool) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    val = records(task, 128, seed=2, chat=chat)
    held_out = frozenset(r["prompt"][:-1] for r in records(task, 128, seed=2))  # no held-out word is trained on
    paths = []
    for name, rows in (("train", records(task, 4000, 1, held_out, chat)), ("val", val)):
        path = directory / f"{task}{'_chat' if chat else ''}_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def task_overrides(directory: Path, task: str, chat: bool) -> list[str]:
    train, val = write_task(directory, task, chat)
    return ["data=files", f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"reward.fn={TASKS[task][1]}"]


def summarise(metrics: Path) -> dict:
    evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"phase": "eval"' in line]
    rl = [json.loads(line) for line in metrics.read_text().splitlines() if '"phase": "rl"' in line]
    # From a separate SFT run (--from-sft) the RL phase's start is the run's "initial" evaluation.
    after_sft = next(e["reward"] for e in evals if e["tag"] == ("after_sft" if any(
        e["tag"] == "after_sft" for e in evals) else "initial"))
    during = [e["reward"] for e in evals if e["tag"] in ("step", "final")]
    kl = [r.get("kl", 0.0) for r in rl]
    return {"after_sft": after_sft, "min_rl": min(during), "final": during[-1],
            "kl_max": max(kl) if kl else 0.0}


# The built-in model's tuned values, which a model.path run would otherwise replace with the
# pretrained ones (configs/algo/grpo.yaml): these models are trained from scratch here, and the
# table in docs/algorithms.md ("Tuning RL on your own task") was measured with these.
BUILTIN_VALUES = {"algo.sft.optim.lr": "3e-3", "algo.actor.optim.lr": "1e-3", "algo.actor.kl_coef": "0.01",
                  "algo.actor.entropy_coef": "0.01"}


def _builtin_values(start: list[str], overrides: list[str]) -> list[str]:
    """BUILTIN_VALUES as overrides for a run started from a model.path, but none the user set."""
    if not start:
        return []
    named = {o.partition("=")[0] for o in overrides}
    return [f"{key}={value}" for key, value in BUILTIN_VALUES.items() if key not in named]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the data and runs go")
    parser.add_argument("--label", default="default")
    parser.add_argument("--tasks", default="sort,shift")
    parser.add_argument("--user-model", action="store_true",
                        help="train a model directory of the user's (BPE tokenizer, chat prompts) via model.path")
    parser.add_argument("--from-sft", action="store_true",
                        help="SFT in a run of its own (algo=sft, full weights), then RL from its export with "
                             "model.path and trainer.sft_steps=0 (e.g. LoRA RL on a fully fine-tuned model)")
    parser.add_argument("overrides", nargs="*", help="extra polyfsdp-train overrides")
    args = parser.parse_args()
    out = Path(args.out)
    model = [f"model.path={write_user_model(out / 'user_model')}"] if args.user_model else []
    for task in args.tasks.split(","):
        run_dir = out / f"{task}{'-user' if args.user_model else ''}-{args.label}"
        data = task_overrides(out / "data", task, args.user_model)
        train = [sys.executable, "-m", "polyfsdp.trainer.train", *data, *BASE_OVERRIDES]
        start = model
        if args.from_sft:
            sft_dir = out / f"{task}{'-user' if args.user_model else ''}-sft_only"
            if not (sft_dir / "final").is_dir():
                sft = [o for o in train if not o.startswith("algo.actor.")]  # algo=sft has no RL keys
                keep = [o for o in _builtin_values(model, []) if o.startswith("algo.sft.")]
                subprocess.run([*sft, *model, *keep, "algo=sft", f"trainer.output_dir={sft_dir}",
                                "trainer.export=true"],
                               check=True, capture_output=True)
            start = [f"model.path={sft_dir / 'final'}", "trainer.sft_steps=0"]
        command = [*train, *start, *_builtin_values(start, args.overrides), f"trainer.output_dir={run_dir}",
                   "trainer.resume=never", *args.overrides]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{task} {args.label}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
            continue
        s = summarise(run_dir / "metrics.jsonl")
        print(f"{task:<10} {args.label:<24} after_sft {s['after_sft']:.3f} min_rl {s['min_rl']:.3f} "
              f"final {s['final']:.3f} kl_max {s['kl_max']:.3f}", flush=True)


if __name__ == "__main__":
    main()
