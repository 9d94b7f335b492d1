"""The built-in character tokenizer as a real Hugging Face fast tokenizer, so an export that
carries it loads with ``AutoTokenizer.from_pretrained`` and encodes, decodes and renders chats
exactly as :class:`~polyfsdp.trainer.data.tokenizers.CharTokenizer` does.

The ``tokenizers`` model is BPE with an empty merge list: with no merges every character is
its own token (``<unk>`` where the vocabulary lacks it); a Fuse decoder joins tokens with no
separator. One difference, as with every Hugging Face tokenizer: a special token's text inside
a string (``"<eos>"``) is that special token, where the character tokenizer spells it out; the
chat template relies on it for ``<bos>``. Like training's prompts (trainer/data/chat.py
``text_prompt_tokens``), a plain ``tokenizer(text)`` starts with ``<bos>``: a post-processor adds it
(``add_special_tokens=False`` leaves it out; the chat template writes its own)."""
from __future__ import annotations

# The character tokenizer's chat rendering (CharTokenizer.chat_text), as a Jinja template.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def hf_tokenizer_of(char_tokenizer):
    """A ``PreTrainedTokenizerFast`` with ``char_tokenizer``'s vocabulary, ids and special tokens."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(char_tokenizer.vocab)}
    pad, bos, eos, unk = (char_tokenizer.vocab[i] for i in (char_tokenizer.pad_token_id, char_tokenizer.bos_token_id,
                                                            char_tokenizer.eos_token_id, char_tokenizer.unk_token_id))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk))
    backend.decoder = decoders.Fuse()
    # The model was trained on <bos> + prompt: without it greedy decoding answers nothing.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, char_tokenizer.bos_token_id)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos,
                                   unk_token=unk, chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)
