"""Held-out evaluation: completions per prompt, greedy or sampled (held_out.py), mean@n and
pass@k (metrics.py), and the validation completions kept in generations.jsonl
(generations_log.py).

The names of held_out.py resolve from the package on first use.
"""
from polyfsdp.engines.moved_modules import names_of

__getattr__ = names_of(__name__, "held_out")
