"""``reward.fn``: finding and calling the reward function (reward_fn.py), the built-in
rules with verl's signature (rules.py), and the time limit of one call (timeout.py).

The names of reward_fn.py resolve from the package on first use.
"""
from polyfsdp.engines.moved_modules import names_of

__getattr__ = names_of(__name__, "reward_fn")
