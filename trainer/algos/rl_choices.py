"""The built-in advantage estimators' and policy losses' names, for ``polyfsdp-train --help``,
which answers before torch loads (the registries, trainer/algos/estimators.py and
trainer/algos/policy_losses.py, import it). tests/cpu/trainer/algos/test_estimator_registry.py keeps these equal
to what is registered."""

ESTIMATOR_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae")
POLICY_LOSS_NAMES = ("ppo", "gspo", "gspo_token")
