"""The GRPO benchmarks' task, tokenizer and checkpoint, all built in code (no download).

A character-level Hugging Face tokenizer (so TRL and polyfsdp read the same files), a toy
addition task (``"12+34="`` -> ``"46"``, exact-match reward) and a Qwen2 checkpoint warmed
up with a few plain-torch SFT steps, so completions end with ``<eos>`` as in a real run.
``long`` mode warms up on answers of 8..256 random characters instead, which gives widely
varying completion lengths (the case padding-free batches are for).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile

import torch

CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyz "
SPECIALS = ("<pad>", "<eos>")
PAD, EOS = 0, 1


def hf_tokenizer():
    """A character-level PreTrainedTokenizerFast: ``<pad>``=0, ``<eos>``=1, no bos."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def addition_examples(n: int, seed: int) -> list[dict]:
    """``n`` prompts ``"a+b="`` with answers ``str(a + b)`` (a, b < 100)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return out


def addition_reward(completion: str, answer: str) -> float:
    """1 for the exact sum (surrounding spaces ignored), else 0."""
    return float(completion.strip() == answer)


def _warm_text(mode: str, rng: random.Random) -> str:
    if mode == "toy":
        ex = addition_examples(1, rng.randrange(1 << 30))[0]
        return ex["prompt"] + ex["answer"]
    ex = addition_examples(1, rng.randrange(1 << 30))[0]
    n = rng.randint(8, 256)
    return ex["prompt"] + "".join(rng.choice(CHARS[12:]) for _ in range(n))


def build_checkpoint(mode: str = "toy", layers: int = 3, hidden: int = 96, warm_steps: int = 30,
                     root: str | None = None) -> str:
    """Write (once, cached by settings) a warmed-up Qwen2 checkpoint + tokenizer; returns its path."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    key = json.dumps([mode, layers, hidden, warm_steps, CHARS, 1], sort_keys=True)
    root = root or os.path.join(tempfile.gettempdir(), "polyfsdp_bench")
    path = os.path.join(root, f"{mode}-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    tokenizer = hf_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=False,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        rng = random.Random(0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(warm_steps):
            rows = [tokenizer.encode(_warm_text(mode, rng)) + [EOS] for _ in range(32)]
            width = max(map(len, rows))
            ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
            mask = (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]).long()
            labels = ids.masked_fill(mask == 0, -100)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(root, exist_ok=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process wrote it first
        pass
    return path


def num_parameters(path: str) -> int:
    """Parameter count of a checkpoint (tied weights counted once)."""
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
