"""Every user-code hook (reward.fn, rollout.env, algo.adv_estimator, algo.actor.policy_loss), each
way it misbehaves, through polyfsdp-train: one line naming the hook (and where it can, the record),
exit status 2, no traceback (issue 38, item 8). The misbehaving code is tests/helpers/misbehaving_hooks.py."""
import os

import pytest

from tests.helpers import HELPERS
from polyfsdp.trainer.train import EXIT_USAGE, main

HOOKS = os.path.join(HELPERS, "misbehaving_hooks.py")
# The smallest RL job: no SFT, one step of 4 prompts x 4 completions.
SMALL = ["trainer.sft_steps=0", "trainer.rl_steps=1", "trainer.prompts_per_step=4", "algo.actor.group_size=4",
         "data.eval_size=4", "trainer.plot=false", "trainer.export=false", "trainer.progress=lines",
         "algo.actor.max_new_tokens=4"]

CASES = [
    ("reward.fn", "reward_raises", "reward.fn=", "raised KeyError"),
    ("reward.fn", "reward_inf", "reward.fn=", "inf"),
    ("reward.fn", "reward_text", "reward.fn=", "'good'"),
    ("reward.fn", "reward_exits", "reward.fn=", "sys.exit(3)"),
    ("rollout.env", "HugeRewardEnv", "rollout.env=", "beyond +-1e+09"),
    ("rollout.env", "NanRewardEnv", "rollout.env=", "expected a finite number"),
    ("rollout.env", "StepRaisesEnv", "rollout.env=", "the simulator crashed"),
    ("rollout.env", "ResetReturnsNoneEnv", "rollout.env=", "reset()"),
    ("algo.adv_estimator", "nan_advantages", "algo.adv_estimator=", "advantages holding nan for sequence 1"),
    ("algo.adv_estimator", "inf_advantages", "algo.adv_estimator=", "advantages holding inf for sequence 1"),
    ("algo.adv_estimator", "estimator_raises", "algo.adv_estimator=", "raised IndexError"),
    ("algo.actor.policy_loss", "string_metric", "algo.actor.policy_loss=", "the metric 'note' is a str"),
    ("algo.actor.policy_loss", "late_string_metric", "algo.actor.policy_loss=", "the metric 'note' is a str"),
    ("algo.actor.policy_loss", "loss_raises", "algo.actor.policy_loss=", "raised ZeroDivisionError"),
]


@pytest.mark.parametrize("key,name,names_hook,says", CASES, ids=[c[1] for c in CASES])
def test_a_misbehaving_hook_is_one_line_and_exit_2(tmp_path, capfd, key, name, names_hook, says):
    code = main([*SMALL, f"{key}={HOOKS}:{name}", f"trainer.output_dir={tmp_path / 'run'}"])
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == EXIT_USAGE and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1 and errors[0].startswith("polyfsdp-train: error: "), err[-2000:]
    assert names_hook in errors[0] and name in errors[0] and says in errors[0], errors[0]
