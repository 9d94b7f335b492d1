"""The built-in character-level tokenizer, and the tokenizer of a model directory.

Tokenizer files: :meth:`CharTokenizer.save_pretrained` writes ``char_tokenizer.json``
(``{"type": "polyfsdp-char", "vocab": [...], "pad": ..., "bos": ..., "eos": ..., "unk": ...}``)
into a directory, beside the same tokenizer as Hugging Face files (trainer/data/char_tokenizer_hf.py);
:func:`load_tokenizer` finds ``char_tokenizer.json`` there first, or falls back to a Hugging Face
tokenizer saved in the same directory.
"""
from __future__ import annotations

import json
import logging
import os
import string

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "char_tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Printable ASCII covers the built-in task and typical small JSONL arithmetic/string data.
DEFAULT_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " +-*/=<>?:.,!()[]_#"


class CharTokenizer:
    """One token per character plus ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``."""

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError(f"tokenizer characters must be unique, got duplicates in {chars!r}")
        self.chars = chars
        self.vocab = list(SPECIAL_TOKENS) + list(chars)
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = range(4)

    def add_chars(self, chars) -> str:
        """Append the characters of ``chars`` it lacks (sorted, so the result depends only on
        the set); returns what was added. Only for a tokenizer no model was built for yet."""
        missing = "".join(sorted(set(chars) - set(self.chars)))
        if missing:
            self.chars += missing
            self.vocab += list(missing)
            self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        return missing

    @property
    def vocab_size(self) -> int:
        """Number of token ids (special tokens included)."""
        return len(self.vocab)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per character, no special tokens (unknown -> ``<unk>``)."""
        return [self._ids.get(ch, self.unk_token_id) for ch in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; stops at the first ``<eos>`` when skipping special tokens."""
        out = []
        for i in (int(x) for x in ids):
            if skip_special_tokens:
                if i == self.eos_token_id:
                    break
                if i < len(SPECIAL_TOKENS):
                    continue
            out.append(self.vocab[i] if 0 <= i < len(self.vocab) else self.vocab[self.unk_token_id])
        return "".join(out)

    # Chat prompts are rendered as "[role] content " with characters every CharTokenizer
    # knows, so chat-format data (data=arith_words) runs on the built-in tokenizer too.
    has_chat_template = True

    @staticmethod
    def chat_text(messages, add_generation_prompt: bool = True) -> str:
        """The text chat ``messages`` render to: ``[role] content `` per message (then ``[assistant] ``)."""
        text = "".join(f"[{m['role']}] {m['content']} " for m in messages)
        return text + "[assistant] " if add_generation_prompt else text

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> list[int]:
        """``<bos>`` then the tokens of :meth:`chat_text`. ``tools`` are not rendered: this
        tokenizer has no tool syntax, so an environment describes its tools in its messages."""
        return [self.bos_token_id] + self.encode(self.chat_text(messages, add_generation_prompt))

    def save_pretrained(self, directory: str) -> None:
        """Write ``char_tokenizer.json`` into ``directory``, and the same tokenizer as Hugging Face
        fast-tokenizer files (``tokenizer.json``, ...) so ``AutoTokenizer`` loads the directory."""
        from .char_tokenizer_hf import hf_tokenizer_of

        os.makedirs(directory, exist_ok=True)
        hf_tokenizer_of(self).save_pretrained(directory)
        payload = {"type": "polyfsdp-char", "chars": self.chars, "vocab": self.vocab,
                   "pad": self.pad_token_id, "bos": self.bos_token_id, "eos": self.eos_token_id,
                   "unk": self.unk_token_id}
        with open(os.path.join(directory, TOKENIZER_FILE), "w") as f:
            json.dump(payload, f, indent=1)

    @classmethod
    def from_pretrained(cls, directory: str) -> "CharTokenizer":
        """Read a tokenizer written by :meth:`save_pretrained`."""
        path = os.path.join(directory, TOKENIZER_FILE)
        with open(path) as f:
            payload = json.load(f)
        if payload.get("type") != "polyfsdp-char" or "chars" not in payload:
            raise ValueError(f"{path}: not a polyfsdp character tokenizer file")
        return cls(payload["chars"])


class HFTokenizerAdapter:
    """A Hugging Face tokenizer behind the small interface the trainer uses."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the checkpoint's tokenizer has no eos token; the trainer needs one to end answers")
        self.eos_token_id = eos
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.bos_token_id = tokenizer.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added tokens included)."""
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, cut at the first eos."""
        ids = [int(x) for x in ids]
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer can render chat messages."""
        return bool(getattr(self.tok, "chat_template", None))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> list[int]:
        """The token ids of ``messages`` rendered by the tokenizer's own chat template (with the
        ``tools`` JSON schemas, when given)."""
        ids = self.tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                           tokenize=True, return_dict=False,
                                           **({"tools": list(tools)} if tools else {}))
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding anyway
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def save_pretrained(self, directory: str) -> None:
        """Save the wrapped tokenizer's files into ``directory``."""
        self.tok.save_pretrained(directory)


def load_tokenizer(directory: str | None, key: str = "model.path"):
    """The tokenizer for a model directory (``char_tokenizer.json`` first, then Hugging Face
    tokenizer files, local only); a fresh :class:`CharTokenizer` when ``directory`` is None.
    ``key`` names the directory's setting in the errors."""
    if directory is None:
        return CharTokenizer()
    if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
        return CharTokenizer.from_pretrained(directory)
    if not any(os.path.isfile(os.path.join(directory, name)) for name in HF_TOKENIZER_FILES):
        raise ValueError(f"{key}={directory}: no tokenizer found (expected {TOKENIZER_FILE} or a Hugging Face "
                         f"tokenizer: {', '.join(HF_TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer

        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(directory, local_files_only=True,
                                                                trust_remote_code=False))
    except Exception as exc:  # no tokenizer files, or an unreadable one
        raise ValueError(
            f"{key}={directory}: no tokenizer found (expected {TOKENIZER_FILE} or Hugging Face "
            f"tokenizer files): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
