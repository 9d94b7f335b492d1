"""The estimator and policy-loss registries (trainer/algos/estimators.py, trainer/algos/policy_losses.py):
the docs list exactly what is registered, a user's estimator from a file outside polyfsdp runs
through polyfsdp-train, and every wrong name is one line."""
import re
from importlib.resources import files

import pytest
import torch

from tests.helpers import HELPERS, ROOT
from polyfsdp.trainer.algos.estimators import ESTIMATORS, needs_text, resolve_estimator
from polyfsdp.trainer.algos.policy_losses import POLICY_LOSSES
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError

ALGORITHMS = ROOT / "docs" / "algorithms.md"
CUSTOM = f"{HELPERS / 'custom_estimator.py'}:median_baseline"


def _yaml_rows(marker: str) -> dict[str, str]:
    """``#   name   summary`` comment rows under the comment line containing ``marker``."""
    text = (files("polyfsdp.configs") / "algo" / "grpo.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if marker in line) + 1
    rows = {}
    for line in text[start:]:
        match = re.match(r"\s*#   (\S+)\s+(.*)$", line)
        if not match and rows:
            break
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def _docs_table(heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading`` in docs/algorithms.md, backticks dropped."""
    lines = ALGORITHMS.read_text().splitlines()
    start = lines.index(heading)
    rows = [line for line in lines[start:] if line.startswith("|")]
    end = next(i for i, line in enumerate(lines[start:]) if line.startswith("|"))
    table = []
    for line in lines[start + end:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    assert rows, heading
    return table[2:]  # header and rule


def test_the_yaml_comment_and_the_docs_list_the_registered_estimators():
    assert _yaml_rows("How advantages are computed") == {n: e.summary for n, e in ESTIMATORS.items()}
    table = _docs_table("### Advantage estimators (`algo.adv_estimator`)")
    assert [row[0] for row in table] == list(ESTIMATORS)
    assert {row[0]: (row[1], row[2]) for row in table} == \
        {n: (needs_text(e), e.summary) for n, e in ESTIMATORS.items()}


def test_the_yaml_comment_and_the_docs_list_the_registered_policy_losses():
    assert _yaml_rows("The policy loss (trainer/algos/policy_losses.py)") == {n: p.summary for n, p in POLICY_LOSSES.items()}
    table = _docs_table("### Policy losses (`algo.actor.policy_loss`)")
    assert [row[0] for row in table] == list(POLICY_LOSSES)
    assert {row[0]: row[2] for row in table} == {n: p.summary for n, p in POLICY_LOSSES.items()}
    for name, declares, _ in table:
        entry = POLICY_LOSSES[name]
        assert declares.startswith(f"clip range {entry.clip_ratio_low:g} / {entry.clip_ratio_high:g} by default")
        assert (f"agg_mode {entry.agg_mode}" in declares) == (entry.agg_mode is not None)


def test_declarations_decide_what_a_config_computes():
    assert ESTIMATORS["gae"].needs_critic and not any(e.needs_critic for n, e in ESTIMATORS.items() if n != "gae")
    rpp = load_config(["algo.adv_estimator=reinforce_plus_plus"]).algo
    assert rpp.kl_in_reward and rpp.actor_loss(32).kl_coef == 0.0
    dr = load_config(["algo.adv_estimator=dr_grpo"]).algo.actor_loss(32)
    assert dr.agg_mode == ESTIMATORS["dr_grpo"].agg_mode
    # The one rule for old log-probs: off policy, or the KL in the reward with a reference.
    one = load_config([]).algo
    loss = one.actor_loss(32)
    assert not one.needs_old_log_probs(loss, has_reference=True)
    assert rpp.needs_old_log_probs(rpp.actor_loss(32), has_reference=True)
    assert not rpp.needs_old_log_probs(rpp.actor_loss(32), has_reference=False)
    many = load_config(["algo.actor.epochs=2"]).algo
    assert many.needs_old_log_probs(many.actor_loss(32), has_reference=False)


@pytest.mark.parametrize("value, start", [
    ("grop", "algo.adv_estimator: got 'grop'; allowed values: grpo, dr_grpo, rloo, reinforce_plus_plus, gae, or "
             "path/to/file.py:NAME / package.module:NAME of your own (did you mean grpo?)"),
    (f"{HELPERS / 'custom_estimator.py'}:not_an_estimator", "algo.adv_estimator="),
    (f"{HELPERS / 'custom_estimator.py'}:missing", "algo.adv_estimator="),
    ("no_such_file.py:fn", "algo.adv_estimator=no_such_file.py:fn: no such file"),
])
def test_a_wrong_estimator_is_one_line_naming_the_key(value, start):
    with pytest.raises(ConfigError) as info:
        load_config([f"algo.adv_estimator={value}"])
    assert str(info.value).startswith(start) and "\n" not in str(info.value), str(info.value)
    if "not_an_estimator" in value:
        assert "is not an estimator; decorate it with" in str(info.value)


def test_a_users_estimator_runs_through_polyfsdp_train_without_editing_polyfsdp(tmp_path):
    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    calls = resolve_estimator(CUSTOM).compute.__globals__["CALLS"]
    calls.clear()
    out = tmp_path / "run"
    code = main(["trainer.sft_steps=1", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
                 "algo.actor.group_size=4", "data.eval_size=8", "trainer.progress=off", "trainer.plot=false",
                 "trainer.export=false", "trainer.checkpoint_interval=0", f"algo.adv_estimator={CUSTOM}",
                 f"trainer.output_dir={out}"])
    assert code == 0
    assert len(calls) == 2  # one rollout per RL step, no critic built (no values), no KL in the reward
    for call in calls:
        rewards = torch.tensor(call["rewards"]).reshape(-1, 4)
        expected = (rewards - rewards.median(dim=1, keepdim=True).values).reshape(-1)
        assert call["advantages"] == pytest.approx(expected.tolist()) and call["group_size"] == 4
        assert call["values"] is None and call["kl"] is None
    steps = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl"]
    assert [r["step"] for r in steps] == [1, 2] and all("pg_loss" in r for r in steps)



def test_the_help_names_equal_the_registries():
    """--help lists names from a torch-free module (trainer/algos/rl_choices.py): it must stay equal."""
    from polyfsdp.trainer.algos.rl_choices import ESTIMATOR_NAMES, POLICY_LOSS_NAMES

    assert ESTIMATOR_NAMES == tuple(ESTIMATORS) and POLICY_LOSS_NAMES == tuple(POLICY_LOSSES)


def test_an_estimator_declaring_multi_turn_false_is_refused_with_an_environment():
    single_turn = f"{HELPERS / 'custom_estimator.py'}:last_turn_only"
    env = f"{HELPERS / 'envs' / 'guess_env.py'}:GuessEnv"
    load_config([f"algo.adv_estimator={single_turn}"])  # fine without an environment
    with pytest.raises(ConfigError, match="declares multi_turn=False") as info:
        load_config([f"algo.adv_estimator={single_turn}", f"rollout.env={env}"])
    assert "\n" not in str(info.value)
    load_config(["algo=ppo", f"rollout.env={env}"])  # GAE skips environment turns


@pytest.mark.parametrize("name, expected", [
    ("raises", "raised KeyError: 'missing' at "),
    ("exits", "called sys.exit(0)"),
    ("returns_a_list", "returned list; return Advantages("),
    ("one_short", "not one tensor per sequence shaped like its mask (expected 8, got 7)"),
])
def test_a_failing_users_estimator_is_one_line_naming_it(tmp_path, capsys, name, expected):
    from polyfsdp.trainer.train import main

    spec = f"{HELPERS / 'custom_estimator.py'}:{name}"
    code = main(["trainer.sft_steps=0", "trainer.rl_steps=1", "trainer.prompts_per_step=2", "algo.actor.group_size=4",
                 "data.eval_size=4", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
                 "trainer.checkpoint_interval=0", f"algo.adv_estimator={spec}", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert f"algo.adv_estimator={spec}" in err[0] and expected in err[0], err[0]
    if name == "raises":
        assert "custom_estimator.py:" in err[0]  # the user's file:line


def test_estimators_read_their_own_hyperparameters_not_the_job_config():
    from polyfsdp.trainer.algos.advantages import group_advantages
    from polyfsdp.trainer.algos.estimators import AdvantageInputs, EstimatorParams
    from polyfsdp.trainer.algos.gae import gae_advantages

    ppo = load_config(["algo=ppo", "algo.critic.gamma=0.9", "algo.critic.lam=0.8",
                       "algo.actor.norm_adv_by_std=false"]).algo
    assert EstimatorParams.of(ppo) == EstimatorParams(norm_adv_by_std=False, gamma=0.9, lam=0.8)
    assert EstimatorParams.of(load_config([]).algo) == EstimatorParams(True, 1.0, 1.0)  # no critic
    rewards, masks = [1.0, 0.0, 0.5, 0.5], [torch.ones(3), torch.ones(2), torch.ones(1), torch.ones(2)]
    values = [torch.full((len(m),), 0.25) for m in masks]
    # No `algo` at all: the built-ins never read the job's config.
    inputs = AdvantageInputs(rewards, masks, 2, None, None, values, None, 0.0,
                             params=EstimatorParams(norm_adv_by_std=False, gamma=0.9, lam=0.8))
    expected = group_advantages(torch.tensor(rewards), 2, "grpo", False)
    assert [a.tolist() for a in ESTIMATORS["grpo"](inputs).advantages] == \
        [[float(a)] * len(m) for a, m in zip(expected, masks)]
    adv, returns = gae_advantages(rewards, masks, values, 0.9, 0.8, None, 0.0)
    result = ESTIMATORS["gae"](inputs)
    assert all(torch.equal(a, b) for a, b in zip(result.advantages + result.returns, adv + returns))
