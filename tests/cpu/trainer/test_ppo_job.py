"""algo=ppo end to end (tiny): config errors name the key, the critic warm-up trains only the
critic, every PPO metric is logged, the critic is a part of the actor's checkpoints."""
from __future__ import annotations

import pytest

from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main

TINY_PPO = ["algo=ppo", "trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=8",
            "trainer.prompts_per_step=4", "algo.actor.group_size=4", "data.eval_size=8", "trainer.progress=off",
            "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=2"]


@pytest.mark.parametrize("override, key", [
    ("algo.adv_estimator=grpo", "algo.adv_estimator"),
    ("algo.critic.gamma=1.5", "algo.critic.gamma"),
    ("algo.critic.lam=-0.1", "algo.critic.lam"),
    ("algo.critic.critic_warmup=-1", "algo.critic.critic_warmup"),
    ("algo.critic.cliprange_value=0", "algo.critic"),
    ("algo.critic.value_agg_mode=seq-mean", "algo.critic.value_agg_mode"),
    ("+algo.critic.vf_coef=0.5", "algo.critic.vf_coef"),
    ("algo.critic.optim.lr=-1", "algo.critic.optim.lr"),
])
def test_bad_ppo_settings_are_one_line_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(["algo=ppo", override])
    assert str(info.value).startswith(key) and "\n" not in str(info.value)


def test_ppo_defaults_and_kl_in_reward_moves_the_kl_out_of_the_loss():
    cfg = load_config(["algo=ppo"])
    assert cfg.algo.name == "ppo" and cfg.algo.adv_estimator == "gae" and cfg.algo.rl
    assert cfg.algo.actor_loss(32).kl_coef == cfg.algo.actor.kl_coef > 0
    assert load_config(["algo=ppo", "algo.critic.kl_in_reward=true"]).algo.actor_loss(32).kl_coef == 0.0
    assert load_config([]).algo.critic is None  # algo=grpo has no critic


def test_tiny_ppo_job_warms_up_the_critic_then_trains_both(tmp_path):
    code = main([*TINY_PPO, "algo.critic.critic_warmup=1", f"trainer.output_dir={tmp_path / 'run'}"])
    assert code == 0
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["phase"] == "rl"]
    assert [r["step"] for r in records] == [1, 2]
    critic_keys = {"vf_loss", "vf_clip_frac", "vf_explained_var", "vf_grad_norm", "returns_mean", "values_mean"}
    for r in records:
        assert critic_keys <= set(r), sorted(critic_keys - set(r))
        assert all(isinstance(r[k], float) and r[k] == r[k] for k in critic_keys)
    warm, both = records
    assert warm["actor_trained"] == 0.0 and "pg_loss" not in warm and "grad_norm" not in warm
    assert both["actor_trained"] == 1.0 and {"pg_loss", "grad_norm", "clip_frac", "entropy"} <= set(both)
    assert warm["vf_grad_norm"] > 0 and both["grad_norm"] > 0
    from polyfsdp.engines.checkpoint import checkpoint_parts, latest_checkpoint

    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["rl", "sft"]  # no critic/ of its own
    assert checkpoint_parts(latest_checkpoint(checkpoints / "rl")) == ["critic"]


def test_ppo_update_many_logs_one_record_per_update_with_both_engines(tmp_path):
    """The one RL step's per-update records hold for PPO too: each optimizer step's record has
    the critic's numbers (vf_*) and, after the warm-up, the actor's; the step's record holds
    their summary."""
    out = tmp_path / "run"
    code = main([*TINY_PPO, "algo.critic.critic_warmup=1", "algo.actor.epochs=2", "trainer.checkpoint_interval=0",
                 f"trainer.output_dir={out}"])
    assert code == 0
    records = read_metrics(str(out / "metrics.jsonl"))
    updates = [r for r in records if r["phase"] == "rl_update"]
    assert [(u["step"], u["update"]) for u in updates] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all({"vf_loss", "vf_grad_norm"} <= set(u) and "vf_updates" not in u for u in updates)
    assert all("pg_loss" not in u for u in updates if u["step"] == 1)  # the critic's warm-up
    assert all({"pg_loss", "grad_norm", "vf_loss"} <= set(u) for u in updates if u["step"] == 2)
    steps = {r["step"]: r for r in records if r["phase"] == "rl"}
    assert steps[1]["vf_updates"] == 2 and steps[2]["updates"] == 2
    assert steps[2]["vf_loss"] == pytest.approx(sum(u["vf_loss"] for u in updates if u["step"] == 2) / 2)
