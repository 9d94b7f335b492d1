"""A ChatML tokenizer built in code (no download): one token per character, ``<|im_end|>``
closing every turn and ``<|endoftext|>`` as eos (a base Qwen tokenizer's layout), or with
``eos="<|im_end|>"`` (SmolLM2-Instruct's and the Qwen instruct models')."""
from __future__ import annotations

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHARS = "".join(map(chr, range(32, 127))) + "\n"  # printable ASCII


def chatml_tokenizer(eos: str = "<|endoftext|>", template: str | None = CHATML):
    """The Hugging Face tokenizer (TokenizersBackend) described above."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<unk>"]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + list(CHARS))}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    extra = [t for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>") if t != eos]
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token="<pad>", unk_token="<unk>",
                                  additional_special_tokens=extra)
    if template is not None:
        tok.chat_template = template
    return tok


def saved_chatml_tokenizer(directory, **options):
    """:func:`chatml_tokenizer` saved to ``directory`` and loaded back as the trainer loads a
    model's tokenizer (trainer/data/tokenizers.py: ``local_files_only=True``)."""
    from polyfsdp.trainer.data.tokenizers import load_tokenizer

    chatml_tokenizer(**options).save_pretrained(str(directory))
    return load_tokenizer(str(directory))
