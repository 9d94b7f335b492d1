"""The algo keys of issue 13: validation (one-line errors naming the key), the schedule's
step count, the loss each setting builds, and DAPO group filtering's bookkeeping."""
import pytest

from polyfsdp.trainer.rollout import sampling
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.sampling import SamplingControls
from polyfsdp.trainer.rollout.drivers.result import Rollout
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.tokenizers import CharTokenizer


@pytest.mark.parametrize("overrides,world,expected", [
    (["algo.actor.mini_batch_size=5"], 1, "algo.actor.mini_batch_size: must divide trainer.prompts_per_step=32, got 5"),
    (["algo.actor.mini_batch_size=1"], 2, "algo.actor.mini_batch_size: must be a multiple of the world size 2"),
    (["algo.actor.mini_batch_size=0"], 1, "algo.actor.mini_batch_size: expected an int >= 1, got 0"),
    (["algo.actor.epochs=0"], 1, "algo.actor.epochs: expected an int >= 1, got 0"),
    (["algo.actor.max_sample_batches=0"], 1, "algo.actor.max_sample_batches: expected an int >= 1"),
    (["algo.adv_estimator=ppo"], 1, "algo.adv_estimator: got 'ppo'; allowed values: grpo, dr_grpo, rloo"),
    (["algo.rollout_correction.tis_cap=0"], 1, "algo.rollout_correction.tis_cap: expected > 0 or null, got 0"),
    (["+algo.rollout_correction.cap=2"], 1, "algo.rollout_correction.cap: unknown key"),
    (["algo.actor.filter_groups=maybe"], 1, "algo.actor.filter_groups: expected bool, got 'maybe'"),
    (["algo.adv_estimator=dr_grpo", "algo.actor.agg_mode=seq-mean-token-mean"], 1,
     "algo.actor.agg_mode: adv_estimator=dr_grpo aggregates with seq-mean-token-sum-norm"),
    (["algo.actor.agg_mode=seq-mean-token-sum-norm"], 1, None),  # a PPO aggregation on its own too
])
def test_new_algo_keys_are_validated(overrides, world, expected):
    if expected is None:
        load_config(overrides)
        return
    with pytest.raises(ConfigError) as info:
        load_config(overrides, world_size=world)
    assert "\n" not in str(info.value) and str(info.value).startswith(expected), str(info.value)


def test_defaults_keep_one_on_policy_update_per_rollout():
    cfg = load_config([])
    loss = cfg.algo.actor_loss(cfg.trainer.prompts_per_step)
    assert cfg.algo.actor.updates_per_rollout(cfg.trainer.prompts_per_step) == 1
    assert loss.on_policy and "old_log_probs" not in loss.required_fields and "rollout_log_probs" not in \
        loss.required_fields
    assert cfg.algo.actor.optim.total_steps == cfg.trainer.rl_steps


def test_update_many_counts_optimizer_steps_in_the_schedule_and_reads_old_log_probs():
    cfg = load_config(["algo.actor.epochs=2", "algo.actor.mini_batch_size=8", "trainer.rl_steps=10"])
    assert cfg.algo.actor.updates_per_rollout(cfg.trainer.prompts_per_step) == 8
    assert cfg.algo.actor.optim.total_steps == 80
    assert "old_log_probs" in cfg.algo.actor_loss(cfg.trainer.prompts_per_step).required_fields


def test_estimators_shape_the_loss():
    dr = load_config(["algo.adv_estimator=dr_grpo", "algo.actor.max_new_tokens=12"]).algo.actor_loss(32)
    assert (dr.agg_mode, dr.agg_norm_tokens) == ("seq-mean-token-sum-norm", 12.0)
    rpp = load_config(["algo.adv_estimator=reinforce_plus_plus"]).algo.actor_loss(32)
    assert rpp.kl_coef == 0.0 and "ref_log_probs" not in rpp.required_fields  # the KL is in the reward
    tis = load_config(["algo.rollout_correction.tis_cap=2"]).algo
    assert tis.rollout_correction.needs_rollout_log_probs and tis.actor_loss(32).tis_cap == 2.0


class _Grpo:
    group_size, max_new_tokens, temperature, filter_groups, max_sample_batches = 2, 4, 1.0, True, 3
    sampling_options = staticmethod(SamplingControls().sampling_options)  # the controls at their defaults


GROUPS = sampling.GroupSampling.of(CharTokenizer(), _Grpo, False)


class _Policy:
    device = "cpu"


class _FixedRewards:
    """A rollout driver whose rounds carry fixed rewards; ``calls``: the prompt batches it was given."""

    def __init__(self, rounds):
        self.rounds, self.calls = rounds, []

    def rollout(self, tokenizer, examples, n, params, **kwargs):
        rewards = self.rounds[len(self.calls)]
        self.calls.append([e.prompt for e in examples])
        rows = [e.prompt for e in examples for _ in range(n)]
        return Rollout([[1]] * len(rows), [[2]] * len(rows), rows, rewards, {"x": list(rewards)}, None)


def test_filter_groups_drops_constant_groups_and_resamples_until_enough():
    examples = [Example(f"p{i}", "a") for i in range(3)]
    # Round 1: only group 1 informative. Round 2: groups 0 and 2 informative (one is enough).
    driver = _FixedRewards([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0]])
    more = lambda k: [Example(f"q{k}{i}", "a") for i in range(3)]  # noqa: E731
    out = sampling.sample_groups(_Policy(), CharTokenizer(), examples, GROUPS, driver, None, more)
    assert driver.calls == [["p0", "p1", "p2"], ["q10", "q11", "q12"]]
    assert out.kept.texts == ["p1", "p1", "q10", "q10", "q12", "q12"]
    assert out.kept.rewards == [0, 1, 0, 1, 1, 0] and out.first.rewards == [1, 1, 0, 1, 0, 0]
    assert out.metrics == {"filter/groups": 3.0, "filter/sample_rounds": 2.0, "filter/short": 0.0}


def test_filter_groups_trains_on_what_there_is_after_max_sample_batches(caplog):
    examples = [Example(f"p{i}", "a") for i in range(2)]
    driver = _FixedRewards([[1, 1, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
    out = sampling.sample_groups(_Policy(), CharTokenizer(), examples, GROUPS, driver, None,
                                 lambda k: [Example(f"q{k}{i}", "a") for i in range(2)])
    assert out.kept.texts == ["p1", "p1"] and out.metrics["filter/short"] == 1.0
    assert out.metrics["filter/sample_rounds"] == 3.0
    assert any("1 of 2 groups per rank" in r.getMessage() for r in caplog.records)
