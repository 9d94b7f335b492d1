"""The job's data: the prompt stream from the built-in tasks or local files (sources.py), one
record (example.py), the string-reversal task (task.py) and the word problems (arith_words.py),
the character tokenizer and a model directory's tokenizer (tokenizers.py, char_tokenizer_hf.py),
demonstration conversations (demonstrations.py), chat templates and the prompt-length policy
(chat.py), and engine batches from token lists (batch.py).

The names of sources.py (``build_source``, ...) resolve from the package on first use.
"""
import importlib
import importlib.util


def __getattr__(name: str):
    # A submodule is imported as itself; any other name is sources.py's, imported on first use.
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    try:
        return getattr(importlib.import_module(f"{__name__}.sources"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
