"""The job's configuration: Hydra composition of the shipped YAML (composition.py), the typed
sections (sections.py, algo.py) converted strictly from it (job.py), the bounds every number is checked
against first (bounds.py), and loading the user's code a key names (plugins.py).

The package itself imports nothing heavy, so composing and checking overrides (``--help``, a
mistyped key) stays free of torch; ``polyfsdp.trainer.config.JobConfig`` and the other names of
``job.py`` resolve on first use.
"""
import importlib
import importlib.util


def __getattr__(name: str):
    # A submodule is imported as itself; any other name is job.py's, imported on first use.
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    try:
        return getattr(importlib.import_module(f"{__name__}.job"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
