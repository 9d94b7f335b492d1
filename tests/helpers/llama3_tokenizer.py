"""A Llama 3 style tokenizer built in code (no download): one token per character, Llama 3's
chat template (a header per message, its content trimmed, ``<|eot_id|>`` closing every turn and
nothing after it) and ``<|end_of_text|>`` as eos (the base Llama 3 tokenizer's layout)."""
from __future__ import annotations

from tests.helpers.chatml_tokenizer import CHARS

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
          "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def llama3_tokenizer():
    """The Hugging Face tokenizer described above."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<pad>", "<unk>"]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + list(CHARS))}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                  pad_token="<pad>", unk_token="<unk>",
                                  additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.chat_template = LLAMA3
    return tok
