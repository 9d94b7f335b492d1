"""algo=ppo end to end (tiny): config errors name the key, the critic warm-up trains only the
critic, every PPO metric is logged, the critic is a part of the actor's checkpoints."""
from __future__ import annotations

import pytest

from polyfsdp.trainer.config import ConfigError, load_config
from polyfsdp.trainer.metrics import read_metrics
from polyfsdp.trainer.train import main

TINY_PPO = ["algo=ppo", "trainer.sft_steps=2", "trainer.grpo_steps=2", "trainer.sft_batch_size=8",
            "trainer.prompts_per_step=4", "algo.grpo.group_size=4", "data.eval_size=8", "trainer.progress=off",
            "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=2"]


@pytest.mark.parametrize("override, key", [
    ("algo.adv_estimator=grpo", "algo.adv_estimator"),
    ("algo.ppo.gamma=1.5", "algo.ppo.gamma"),
    ("algo.ppo.lam=-0.1", "algo.ppo.lam"),
    ("algo.ppo.critic_warmup=-1", "algo.ppo.critic_warmup"),
    ("algo.ppo.cliprange_value=0", "algo.ppo"),
    ("algo.ppo.value_agg_mode=seq-mean", "algo.ppo.value_agg_mode"),
    ("+algo.ppo.vf_coef=0.5", "algo.ppo.vf_coef"),
    ("algo.ppo.optim.lr=-1", "algo.ppo.optim.lr"),
])
def test_bad_ppo_settings_are_one_line_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(["algo=ppo", override])
    assert str(info.value).startswith(key) and "\n" not in str(info.value)


def test_ppo_defaults_and_kl_in_reward_moves_the_kl_out_of_the_loss():
    cfg = load_config(["algo=ppo"])
    assert cfg.algo.name == "ppo" and cfg.algo.adv_estimator == "gae" and cfg.algo.rl
    assert cfg.algo.ppo_loss(32).kl_coef == cfg.algo.grpo.kl_coef > 0
    assert load_config(["algo=ppo", "algo.ppo.kl_in_reward=true"]).algo.ppo_loss(32).kl_coef == 0.0
    assert load_config([]).algo.ppo is None  # algo=grpo has no critic


def test_tiny_ppo_job_warms_up_the_critic_then_trains_both(tmp_path):
    code = main([*TINY_PPO, "algo.ppo.critic_warmup=1", f"trainer.output_dir={tmp_path / 'run'}"])
    assert code == 0
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["phase"] == "grpo"]
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
    assert sorted(p.name for p in checkpoints.iterdir()) == ["grpo", "sft"]  # no critic/ of its own
    assert checkpoint_parts(latest_checkpoint(checkpoints / "grpo")) == ["critic"]
