"""Held-out evaluation: completions per prompt, greedy or sampled (held_out.py), mean@n and
pass@k (metrics.py), and the validation completions kept in generations.jsonl
(generations_log.py).

The names of held_out.py resolve from the package on first use.
"""
import importlib
import importlib.util


def __getattr__(name: str):
    # A submodule is imported as itself; any other name is held_out.py's, imported on first use.
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    try:
        return getattr(importlib.import_module(f"{__name__}.held_out"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
