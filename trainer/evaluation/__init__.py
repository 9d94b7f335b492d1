"""Held-out evaluation: completions per prompt, greedy or sampled (held_out.py), mean@n and
pass@k (metrics.py), and the validation completions kept in generations.jsonl
(generations_log.py).
"""
