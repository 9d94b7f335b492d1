"""A continued run keeps what decides its meaning (trainer/run/resume.py check_same_run): the
algorithm and every algo setting, the SFT step count once the RL phase began, and a run
directory without config.yaml is refused rather than continued unchecked."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.run.resume import check_same_run
from polyfsdp.trainer.train import main


def _run_dir(tmp_path, overrides=(), holds=("checkpoints",)):
    run = tmp_path / "run"
    for name in holds:
        (run / name).mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(load_config(list(overrides)).raw), run / "config.yaml")
    return run


@pytest.mark.parametrize("saved, override, name, before, now", [
    ([], "algo.adv_estimator=rloo", "algo.adv_estimator", "'grpo'", "'rloo'"),
    ([], "algo.rollout_correction.tis_cap=2.0", "algo.rollout_correction.tis_cap", "None", "2.0"),
    ([], "algo.rollout_correction.report_mismatch=true", "algo.rollout_correction.report_mismatch", "'auto'",
     "True"),
    ([], "algo.actor.agg_mode=seq-mean-token-mean", "algo.actor.agg_mode", "'token-mean'", "'seq-mean-token-mean'"),
    ([], "algo.actor.kl_type=k1", "algo.actor.kl_type", "'k3'", "'k1'"),
    ([], "algo.actor.group_size=4", "algo.actor.group_size", "8", "4"),
    ([], "algo.sft.agg_mode=seq-mean-token-sum", "algo.sft.agg_mode", "'token-mean'", "'seq-mean-token-sum'"),
    ([], "algo=ppo", "algo.name", "'grpo'", "'ppo'"),
    (["algo=ppo"], "algo=grpo", "algo.name", "'ppo'", "'grpo'"),
    (["algo=ppo"], "algo.critic.lam=0.9", "algo.critic.lam", "1.0", "0.9"),
    ([], "algo=sft", "algo.name", "'grpo'", "'sft'"),
])
def test_continuing_with_another_algorithm_or_algo_setting_names_the_key(tmp_path, saved, override, name, before,
                                                                        now):
    run = _run_dir(tmp_path, saved)
    with pytest.raises(ConfigError) as info:
        check_same_run(load_config([*saved, override]), run)
    message = str(info.value)
    assert "\n" not in message
    assert f"holds a run of {name}={before}, but this run asks for {name}={now};" in message, message


def test_an_sft_run_may_continue_into_either_rl_algorithm_keeping_its_sft_settings(tmp_path):
    run = _run_dir(tmp_path, ["algo=sft"])
    check_same_run(load_config(["algo=ppo", "algo.rollout_correction.tis_cap=2.0"]), run)
    check_same_run(load_config(["algo.adv_estimator=rloo"]), run)
    with pytest.raises(ConfigError, match=r"algo.sft.optim.lr=0.003, but this run asks for algo.sft.optim.lr=0.1;"):
        check_same_run(load_config(["algo=ppo", "algo.sft.optim.lr=0.1"]), run)


def test_the_sft_step_count_stays_once_the_rl_phase_has_its_start(tmp_path):
    run = _run_dir(tmp_path)
    check_same_run(load_config(["trainer.sft_steps=60"]), run)  # still in SFT: more SFT steps is fine
    (run / "checkpoints" / "rl").mkdir()
    with pytest.raises(ConfigError, match=r"trainer.sft_steps=40, but this run asks for trainer.sft_steps=0;"):
        check_same_run(load_config(["trainer.sft_steps=0"]), run)
    check_same_run(load_config(["trainer.rl_steps=300"]), run)


@pytest.mark.parametrize("holds", [("init_model",), ("checkpoints", "init_model")])
def test_a_run_directory_without_config_yaml_is_refused_in_one_line(tmp_path, holds):
    # Its init_model would be reused whatever model.overrides say now: nothing to check them against.
    run = _run_dir(tmp_path, holds=holds)
    (run / "config.yaml").unlink()
    with pytest.raises(ConfigError) as info:
        check_same_run(load_config(["model.overrides.num_hidden_layers=3"]), run)
    assert str(info.value) == (
        f"trainer.resume=auto: {run} holds a run ({', '.join(sorted(holds))}) but no config.yaml, so this run's "
        f"settings (model.overrides, data, algo) cannot be checked against it; put its config.yaml back or choose "
        f"another trainer.output_dir")
    # An empty directory (or one that never got that far) holds nothing to clash with.
    check_same_run(load_config(["model.overrides.num_hidden_layers=3"]), tmp_path / "elsewhere")


TINY = ["trainer.sft_steps=1", "trainer.rl_steps=1", "trainer.sft_batch_size=4", "trainer.prompts_per_step=2",
        "algo.actor.group_size=2", "data.eval_size=2", "trainer.progress=off", "trainer.plot=false",
        "trainer.export=false", "trainer.checkpoint_interval=1"]


def test_a_refused_continuation_leaves_config_yaml_as_the_run_wrote_it(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, f"trainer.output_dir={out}"]) == 0
    written = (out / "config.yaml").read_text()
    capsys.readouterr()
    assert main([*TINY, "trainer.rl_steps=2", "algo.adv_estimator=rloo", f"trainer.output_dir={out}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "holds a run of algo.adv_estimator='grpo', but this run asks for " \
        "algo.adv_estimator='rloo';" in err[0], err
    assert (out / "config.yaml").read_text() == written

    (out / "config.yaml").unlink()
    assert main([*TINY, "trainer.rl_steps=2", "model.overrides.num_hidden_layers=3",
                 f"trainer.output_dir={out}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "but no config.yaml" in err[0], err
    assert not (out / "config.yaml").exists()


def test_a_run_saved_before_the_sampling_controls_existed_continues_with_their_defaults(tmp_path):
    run = _run_dir(tmp_path)
    saved = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))
    for key in ("top_p", "top_k", "repetition_penalty", "stop"):
        del saved["algo"]["actor"][key]
    OmegaConf.save(OmegaConf.create(saved), run / "config.yaml")
    check_same_run(load_config([]), run)
    with pytest.raises(ConfigError, match=r"algo.actor.top_p=1.0, but this run asks for algo.actor.top_p=0.9;"):
        check_same_run(load_config(["algo.actor.top_p=0.9"]), run)
