"""algo.rollout_correction in the job config: ``tis_cap: auto`` and ``report_mismatch: auto``
follow rollout.max_staleness (trainer/config/algo.py, resolved in build_job_config), the
masked-importance-sampling keys, their one-line refusals, and a continued run's comparison."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from polyfsdp.trainer.config.algo import ASYNC_TIS_CAP
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.run.resume import check_same_run

RC = "algo.rollout_correction"


@pytest.mark.parametrize("overrides,tis_cap,report", [
    ([], None, False),
    (["rollout.max_staleness=1"], ASYNC_TIS_CAP, True),
    (["algo=ppo", "rollout.max_staleness=3"], ASYNC_TIS_CAP, True),
    (["rollout.max_staleness=1", "algo.actor.policy_loss=gspo"], None, True),  # no per-token corrections
    (["rollout.max_staleness=1", "algo.actor.policy_loss=gspo_token"], None, True),
    (["rollout.max_staleness=1", f"{RC}.tis_cap=null"], None, True),  # explicit null: off
    (["rollout.max_staleness=1", f"{RC}.tis_cap=5"], 5, True),
    ([f"{RC}.tis_cap=1.5"], 1.5, False),
    (["rollout.max_staleness=1", f"{RC}.report_mismatch=false"], ASYNC_TIS_CAP, False),
    (["algo=sft", "rollout.max_staleness=1"], None, True),
])
def test_auto_follows_the_staleness_and_the_policy_loss(overrides, tis_cap, report):
    cfg = load_config(overrides)
    rc = cfg.algo.rollout_correction
    assert (rc.tis_cap, rc.report_mismatch) == (tis_cap, report)
    assert rc.needs_rollout_log_probs == (report or tis_cap is not None)
    if cfg.algo.rl:
        # config.yaml (and --cfg) keep what was asked for, as for report_mismatch's auto: the raw config.
        asked = [o.split("=")[1] for o in overrides if o.startswith(f"{RC}.tis_cap=")]
        assert cfg.raw["algo"]["rollout_correction"]["tis_cap"] == \
            (None if asked == ["null"] else float(asked[0]) if asked else "auto")
        assert cfg.algo.actor_loss(cfg.trainer.prompts_per_step).tis_cap == tis_cap


def test_the_masks_reach_the_policy_loss_and_record_the_sampler_log_probs():
    cfg = load_config([f"{RC}.mask_low=0.5", f"{RC}.mask_high=2", f"{RC}.mask_level=sequence"])
    rc = cfg.algo.rollout_correction
    assert rc.needs_rollout_log_probs and not rc.report_mismatch
    loss = cfg.algo.actor_loss(cfg.trainer.prompts_per_step)
    assert (loss.mask_low, loss.mask_high, loss.mask_level) == (0.5, 2, "sequence")
    assert "rollout_log_probs" in loss.required_fields
    assert load_config([f"{RC}.mask_high=1.2"]).algo.actor_loss(32).mask_low is None


@pytest.mark.parametrize("overrides,message", [
    ([f"{RC}.tis_cap=always"], f"{RC}.tis_cap: expected auto, a number > 0 or null, got 'always'"),
    ([f"{RC}.tis_cap=-1"], f"{RC}.tis_cap: expected > 0 or null, got -1"),
    ([f"{RC}.mask_low=0"], f"{RC}.mask_low: expected > 0 or null, got 0"),
    ([f"{RC}.mask_high=-0.5"], f"{RC}.mask_high: expected > 0 or null, got -0.5"),
    ([f"{RC}.mask_low=2", f"{RC}.mask_high=1.5"], f"{RC}.mask_low: must be below {RC}.mask_high=1.5, got 2"),
    ([f"{RC}.mask_low=1.5", f"{RC}.mask_high=1.5"], f"{RC}.mask_low: must be below {RC}.mask_high=1.5, got 1.5"),
    ([f"{RC}.mask_level=geometric"], f"{RC}.mask_level: got 'geometric'; allowed values: token, sequence"),
    ([f"{RC}.mask_low=abc"], f"{RC}.mask_low: expected float or null, got 'abc'"),
    ([f"{RC}.mask_high=nan"], f"{RC}.mask_high: expected a finite number, got nan"),
    (["algo.actor.policy_loss=gspo", f"{RC}.mask_low=0.5"],
     f"{RC}.mask_low: applies to the per-token ppo policy loss, not to policy_loss=gspo; leave it null"),
    (["algo.actor.policy_loss=gspo_token", f"{RC}.mask_high=2"],
     f"{RC}.mask_high: applies to the per-token ppo policy loss, not to policy_loss=gspo_token; leave it null"),
])
def test_bad_values_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert str(info.value) == message


def _saved_run(tmp_path, raw: dict):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(raw), run / "config.yaml")
    return run


def test_a_run_saved_before_tis_cap_auto_and_the_masks_continues_under_the_new_defaults(tmp_path):
    raw = load_config([]).raw
    correction = raw["algo"]["rollout_correction"]
    for key in ("mask_low", "mask_high", "mask_level"):
        del correction[key]
    correction["tis_cap"] = None  # the old default
    del raw["rollout"]["max_staleness"]
    check_same_run(load_config([]), _saved_run(tmp_path, raw))


@pytest.mark.parametrize("saved,now,before,asked", [
    (["rollout.max_staleness=1", f"{RC}.tis_cap=null"], ["rollout.max_staleness=1"], None, ASYNC_TIS_CAP),
    ([f"{RC}.tis_cap=2.0"], [], 2.0, None),
    ([], [f"{RC}.mask_level=sequence"], "'token'", "'sequence'"),
])
def test_a_continued_run_compares_tis_cap_by_the_value_it_uses(tmp_path, saved, now, before, asked):
    run = _saved_run(tmp_path, load_config(saved).raw)
    with pytest.raises(ConfigError) as info:
        check_same_run(load_config(now), run)
    key = f"{RC}.mask_level" if "mask_level" in str(now) else f"{RC}.tis_cap"
    assert f"holds a run of {key}={before}, but this run asks for {key}={asked};" in str(info.value)
    # auto at staleness 1 is 2.0, which the explicit value matches.
    explicit = tmp_path / "explicit"
    (explicit / "checkpoints").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(load_config(["rollout.max_staleness=1", f"{RC}.tis_cap=2.0"]).raw),
                   explicit / "config.yaml")
    check_same_run(load_config(["rollout.max_staleness=1"]), explicit)
