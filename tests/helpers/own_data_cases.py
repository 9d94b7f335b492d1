"""Shared by the bring-your-own-data tests: a real byte-level BPE tokenizer with a chat
template, trained here, saved next to a tiny Qwen2 checkpoint, and verl-layout records."""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["Tom has 3 apples and gets 4 more. How many apples does Tom have now? 3+4=7. #### 7",
          "What is 12 plus 30? The answer is \\boxed{42}.", "Reverse abc: cba", "user assistant system"]


def bpe_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (Qwen-like special tokens) trained on a tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def write_model_dir(directory: Path, chat_template: str | None = CHAT_TEMPLATE, max_positions: int = 256) -> Path:
    """A tiny Qwen2 checkpoint plus the BPE tokenizer in ``directory`` (``model.path=`` ready)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = bpe_tokenizer(chat_template)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def verl_record(question: str, answer: str, source: str = "toy", chat: bool = True, **extra) -> dict:
    """One record in verl's RL layout."""
    prompt = [{"role": "user", "content": question}] if chat else question
    return {"data_source": source, "prompt": prompt, "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": extra.pop("index", 0), **extra}}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)
