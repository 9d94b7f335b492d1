"""``reward.fn``: finding and calling the reward function (reward_fn.py), the built-in
rules with verl's signature (rules.py), and the time limit of one call (timeout.py).
"""
