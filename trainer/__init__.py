"""The training application: Hydra entrypoint, SFT and RL loops, the built-in task."""
from .startup import interrupted_while_starting

try:
    # Imported first so its guard against torch's device-extension auto-loading runs before torch.
    import polyfsdp.backends  # noqa: F401
except KeyboardInterrupt:
    # Ctrl-C during `import torch` (seconds): the console script imports this package before
    # main() runs, so this is the only place that can turn it into one line and status 130.
    raise interrupted_while_starting() from None

# Module paths before the move into sub-packages keep working (engines/moved_modules.py).
from polyfsdp.engines.moved_modules import install as _install_moved

MOVED_MODULES = {
    "polyfsdp.trainer.advantages": "polyfsdp.trainer.algos.advantages",
    "polyfsdp.trainer.algo_config": "polyfsdp.trainer.config.algo",
    "polyfsdp.trainer.arith_words": "polyfsdp.trainer.data.arith_words",
    "polyfsdp.trainer.batch": "polyfsdp.trainer.data.batch",
    "polyfsdp.trainer.char_tokenizer_hf": "polyfsdp.trainer.data.char_tokenizer_hf",
    "polyfsdp.trainer.chat": "polyfsdp.trainer.data.chat",
    "polyfsdp.trainer.compose": "polyfsdp.trainer.config.composition",
    "polyfsdp.trainer.config_bounds": "polyfsdp.trainer.config.bounds",
    "polyfsdp.trainer.config_sections": "polyfsdp.trainer.config.sections",
    "polyfsdp.trainer.decode": "polyfsdp.trainer.rollout.decode",
    "polyfsdp.trainer.demonstrations": "polyfsdp.trainer.data.demonstrations",
    "polyfsdp.trainer.environments": "polyfsdp.trainer.rollout.environments",
    "polyfsdp.trainer.estimate": "polyfsdp.trainer.run.estimate",
    "polyfsdp.trainer.estimate_turns": "polyfsdp.trainer.run.estimate_turns",
    "polyfsdp.trainer.estimators": "polyfsdp.trainer.algos.estimators",
    "polyfsdp.trainer.eval_metrics": "polyfsdp.trainer.evaluation.metrics",
    "polyfsdp.trainer.flat_sampling": "polyfsdp.trainer.rollout.flat_sampling",
    "polyfsdp.trainer.gae": "polyfsdp.trainer.algos.gae",
    "polyfsdp.trainer.generate": "polyfsdp.trainer.rollout.generate",
    "polyfsdp.trainer.generations_log": "polyfsdp.trainer.evaluation.generations_log",
    "polyfsdp.trainer.job": "polyfsdp.trainer.run.job",
    "polyfsdp.trainer.job_checkpoints": "polyfsdp.trainer.run.checkpoints",
    "polyfsdp.trainer.job_data": "polyfsdp.trainer.run.job_data",
    "polyfsdp.trainer.metrics": "polyfsdp.trainer.tracking.metrics",
    "polyfsdp.trainer.model_export": "polyfsdp.trainer.run.export",
    "polyfsdp.trainer.model_init": "polyfsdp.trainer.run.model_init",
    "polyfsdp.trainer.multi_turn": "polyfsdp.trainer.rollout.drivers.multi_turn",
    "polyfsdp.trainer.phases": "polyfsdp.trainer.run.phases",
    "polyfsdp.trainer.plot": "polyfsdp.trainer.tracking.plot",
    "polyfsdp.trainer.plugins": "polyfsdp.trainer.config.plugins",
    "polyfsdp.trainer.policy_losses": "polyfsdp.trainer.algos.policy_losses",
    "polyfsdp.trainer.progress": "polyfsdp.trainer.run.progress",
    "polyfsdp.trainer.resume": "polyfsdp.trainer.run.resume",
    "polyfsdp.trainer.reward_rules": "polyfsdp.trainer.rewards.rules",
    "polyfsdp.trainer.reward_timeout": "polyfsdp.trainer.rewards.timeout",
    "polyfsdp.trainer.rl_choices": "polyfsdp.trainer.algos.rl_choices",
    "polyfsdp.trainer.rl_step": "polyfsdp.trainer.algos.rl_step",
    "polyfsdp.trainer.rollout_engines": "polyfsdp.trainer.rollout.engines",
    "polyfsdp.trainer.rollout.multi_turn": "polyfsdp.trainer.rollout.drivers.multi_turn",
    "polyfsdp.trainer.row_sampler": "polyfsdp.trainer.rollout.row_sampler",
    "polyfsdp.trainer.row_seeds": "polyfsdp.trainer.rollout.row_seeds",
    "polyfsdp.trainer.run_state": "polyfsdp.trainer.run.state",
    "polyfsdp.trainer.sampling": "polyfsdp.trainer.rollout.sampling",
    "polyfsdp.trainer.sft": "polyfsdp.trainer.algos.sft",
    "polyfsdp.trainer.stop": "polyfsdp.trainer.run.stop",
    "polyfsdp.trainer.task": "polyfsdp.trainer.data.task",
    "polyfsdp.trainer.tool_sft": "polyfsdp.trainer.algos.tool_sft",
    "polyfsdp.trainer.tool_task": "polyfsdp.trainer.rollout.tool_task",
    "polyfsdp.trainer.updates": "polyfsdp.trainer.algos.updates",
    "polyfsdp.trainer.vllm_adapter": "polyfsdp.trainer.rollout.vllm_adapter",
    "polyfsdp.trainer.vllm_rollout": "polyfsdp.trainer.rollout.vllm",
}
_install_moved(MOVED_MODULES)
