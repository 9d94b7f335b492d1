"""Rollout drivers: run examples through a rollout engine (trainer/rollout/engines.py) and score
them. A driver never syncs weights: the caller brings ``driver.engine`` to the policy's weights
(``update_weights``) before a rollout and lets it sleep after.

Every driver has ``engine`` and ``rollout(tokenizer, examples, n, params, scorer=None,
with_answers=False, row_seeds=None, device=None) -> Rollout`` (``result.py``): ``n`` rows per
example, grouped (example i owns rows i*n .. i*n+n-1); ``row_seeds``, one sampling seed per row
(trainer/rollout/row_seeds.py), else the process's generator draws; ``device``, where a collective
between ranks runs (the policy's).

- ``single_turn.py``: ``SingleTurnDriver``, one completion per row (no ``rollout.env``);
- ``multi_turn.py``: ``MultiTurnDriver``, conversations with the environment ``rollout.env``.
"""
