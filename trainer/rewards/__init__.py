"""``reward.fn``: finding and calling the reward function (reward_fn.py), the built-in
rules with verl's signature (rules.py), and the time limit of one call (timeout.py).

The names of reward_fn.py resolve from the package on first use.
"""
import importlib
import importlib.util


def __getattr__(name: str):
    # A submodule is imported as itself; any other name is reward_fn.py's, imported on first use.
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    try:
        return getattr(importlib.import_module(f"{__name__}.reward_fn"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
