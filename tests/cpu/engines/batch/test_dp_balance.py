"""The token-balanced assignment over data-parallel replicas (engines/batch/dp_balance.py) on the
host; the exchange and order restore over ranks: tests/distributed/test_dp_balance_ranks.py."""
import pytest

from polyfsdp.engines.config import ConfigFieldError, EngineConfig
from polyfsdp.engines.batch.dp_balance import balance_plan, token_imbalance


def test_token_imbalance_is_max_over_mean():
    assert token_imbalance([30, 10]) == pytest.approx(1.5)
    assert token_imbalance([5, 5, 5]) == 1.0
    assert token_imbalance([0, 0]) == 1.0


def test_plan_places_every_sequence_once_and_balances_a_skewed_batch():
    lengths = [[40, 33, 20, 18, 9], [2, 3], [1], [5, 4, 4]]
    plan = balance_plan(lengths)
    placed = sorted(item for group in plan for item in group)
    assert placed == sorted((r, i) for r, lens in enumerate(lengths) for i in range(len(lens)))
    loads = [sum(lengths[r][i] for r, i in group) for group in plan]
    before = token_imbalance([sum(lens) for lens in lengths])
    assert before > 3.0 and token_imbalance(loads) < 1.3
    # Longest-first greedy: no replica's load exceeds the ideal by more than the longest item it got last.
    assert max(loads) <= sum(loads) / len(loads) + max(max(lens) for lens in lengths)


def test_balance_flag_must_be_a_bool():
    with pytest.raises(ConfigFieldError, match="EngineConfig.balance_dp_tokens"):
        EngineConfig(balance_dp_tokens="yes")
