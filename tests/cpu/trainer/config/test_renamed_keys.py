"""The RL phase's neutral names: an old key is one line naming the new one, a run written with
the old names is refused with one line, and polyfsdp-eval still reads its config."""
import pytest
from omegaconf import OmegaConf

from polyfsdp.trainer.config.composition import upgrade_saved_config
from polyfsdp.trainer.config.job import build_job_config, load_config
from polyfsdp.trainer.errors import ConfigError


@pytest.mark.parametrize("override, line", [
    ("trainer.grpo_steps=5", "trainer.grpo_steps: trainer.grpo_steps was renamed trainer.rl_steps"),
    ("algo.grpo.group_size=4", "algo.grpo.group_size: algo.grpo was renamed algo.actor (algo.actor.group_size)"),
    ("algo.ppo.gamma=0.9", "algo.ppo.gamma: algo.ppo was renamed algo.critic (algo.critic.gamma)"),
    ("+trainer.grpo_steps=5", "trainer.grpo_steps: trainer.grpo_steps was renamed trainer.rl_steps"),
    # The old key was wrong as well: the new name is unknown too, and the hint is its close match.
    ("algo.grpo.lr=1e-4", "algo.grpo.lr: algo.grpo was renamed algo.actor (algo.actor.lr), which is unknown too; "
                          "did you mean algo.actor.optim.lr?"),
    ("algo.grpo.optim.lr=1e-4", "algo.grpo.optim.lr: algo.grpo was renamed algo.actor (algo.actor.optim.lr)"),
])
def test_an_old_key_is_one_line_naming_the_new_one(override, line):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert str(info.value) == line


def _old_raw(**algo_extra):
    """A config.yaml as a polyfsdp before the rename wrote it."""
    raw = load_config(["algo=ppo"]).raw
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    raw["algo"]["grpo"] = raw["algo"].pop("actor")
    raw["algo"]["ppo"] = raw["algo"].pop("critic")
    raw["algo"]["grpo"].pop("policy_loss")
    raw["algo"]["grpo"].update(clip_ratio_low=0.2, clip_ratio_high=0.28)
    raw["trainer"]["grpo_steps"] = raw["trainer"].pop("rl_steps")
    return raw


def test_an_old_saved_config_reads_with_the_new_names():
    cfg = build_job_config(upgrade_saved_config(_old_raw()))
    assert cfg.algo.actor.clip_ratio_low == 0.2 and cfg.algo.critic.gamma == 1.0
    assert cfg.trainer.rl_steps == 150 and cfg.algo.estimator.needs_critic


def test_a_run_written_with_the_old_names_is_refused_in_one_line(tmp_path):
    from polyfsdp.trainer.run.resume import check_same_run, find_resume

    old = tmp_path / "old"
    (old / "checkpoints" / "grpo" / "step_000002").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(_old_raw()), old / "config.yaml")
    cfg = load_config(["algo=ppo", f"trainer.output_dir={old}"])
    for check in (lambda: check_same_run(cfg, old), lambda: find_resume(cfg, old),
                  lambda: find_resume(load_config([f"trainer.resume={old / 'checkpoints' / 'grpo'}"]), old)):
        with pytest.raises(ConfigError) as info:
            check()
        text = str(info.value)
        assert "\n" not in text and text.startswith(f"trainer.resume: {old} was started by a polyfsdp that named "
                                                    f"the RL phase grpo") and "checkpoints/rl/" in text, text
