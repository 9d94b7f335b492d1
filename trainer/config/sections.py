"""The job configuration's sections as dataclasses: one per Hydra group the trainer owns
(``model``, ``data``, ``reward``, ``rollout``, ``eval``, ``trainer``; ``algo``'s are in
trainer/config/algo.py, ``engine``'s are the engine's own) and :class:`JobConfig`, all of them.

Only the shapes and defaults live here; trainer/config/job.py builds them from the composed config
and validates them (configs/*.yaml hold the same defaults).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polyfsdp.engines.config import EngineConfig, ModelConfig

from .algo import AlgoSection
from .sampling import SamplingControls


@dataclass
class ModelSection:
    """A tiny preset (with Hugging Face config ``overrides``) or a local checkpoint ``path``."""

    preset: str | None = "qwen2-tiny"
    path: str | None = None
    dtype: str = "float32"
    attn_implementation: str | None = None
    seed: int = 0
    overrides: dict = field(default_factory=dict)
    lora: dict = field(default_factory=dict)  # the engine's LoraConfig keys; rank 0: no adapters

    def model_config(self, vocab_size: int | None = None, path: str | None = None) -> ModelConfig:
        """The engine's ModelConfig: from ``path`` (given or configured) else the preset;
        a bad field raises naming it as ``model.<field>``."""
        path = path or self.path
        return ModelConfig.from_dict({"preset": None if path else self.preset, "path": path, "dtype": self.dtype,
                                      "attn_implementation": self.attn_implementation,
                                      "vocab_size": None if path else vocab_size, "seed": self.seed,
                                      "lora": dict(self.lora)}, where="model")


@dataclass
class DataSection:
    """Where prompts and answers come from: the built-in task or a local file."""

    source: str = "builtin"
    task: str = "reverse"
    alphabet: str = "abcdefgh"
    min_len: int = 3
    max_len: int = 5
    path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str | None = None
    eval_size: int = 128
    train_files: list | str | None = None
    val_files: list | str | None = None
    apply_chat_template: bool = False
    max_prompt_length: int | None = None
    overlong: str = "filter"


@dataclass
class RewardModelSection:
    """``reward.model``: a local reward-model checkpoint scoring prompt + completion
    (trainer/rewards/reward_model.py); ``path: null``: none. Its score, times ``weight``, is
    added to the reward of the records whose ``data_source`` is in ``data_sources`` (null: all)."""

    path: str | None = None
    name: str = "model"  # logged as reward/<name>
    weight: float = 1.0
    data_sources: list | None = None
    template: str = "auto"  # auto | chat | none: how prompt + completion become the model's text
    value_head_path: str | None = None  # a causal LM with this value head file instead of a classifier
    max_tokens_per_batch: int | None = None  # tokens per forward; null: engine.max_tokens_per_micro_batch
    offload: bool = False  # keep its shards in host memory between forwards (engine offload=params)


@dataclass
class RewardSection:
    """``reward.fn``: a built-in rule, ``path/to/file.py:fn`` or ``package.module:fn``
    (``auto``: the data's own rule; ``none``: no function, a reward model alone); ``kwargs`` are
    extra keyword arguments to it. ``weight`` and ``data_sources`` place it in the weighted sum
    of the reward's sources (trainer/rewards/sources.py), beside ``model``."""

    fn: str = "auto"
    kwargs: dict | None = None
    timeout_s: float | None = 60.0  # one call's limit (trainer/rewards/timeout.py); null: none
    weight: float = 1.0
    data_sources: list | None = None
    model: RewardModelSection = field(default_factory=RewardModelSection)
    judge: dict | None = None  # a generative judge's settings (trainer/rewards/judge.py: JudgeSettings)


@dataclass
class RolloutSection:
    """Generation: ``engine`` samples (trainer/rollout/engines.py); ``unshard`` (auto | true |
    false) gathers the model once per rollout instead of once per layer per decoding step
    (trainer/rollout/generate.py); the rest is vLLM's (trainer/rollout/vllm.py)."""

    engine: str = "auto"
    unshard: bool | str = "auto"
    sync_bucket_mb: float = 64.0
    check_sync: bool = True
    check_sync_tol: float = 1e-3
    vllm: dict = field(default_factory=dict)
    # rollout.engine=vllm_server: where the servers run (trainer/rollout/servers/settings.py).
    server: dict = field(default_factory=dict)
    # Multi-turn (trainer/rollout/drivers/multi_turn.py): an environment plug-in and its limits.
    env: str | None = None
    env_kwargs: dict = field(default_factory=dict)
    max_turns: int = 1
    max_total_tokens: int | None = None
    env_add_reward_fn: bool = False
    env_timeout_s: float | None = 60.0
    # Agents from any framework (trainer/rollout/drivers/agent.py): FILE.py:fn or module:fn, talking
    # to the engine through an OpenAI-compatible endpoint on loopback; instead of env.
    agent: str | None = None
    agent_concurrency: int = 64
    # Asynchronous RL (trainer/algos/sample_ahead.py): the batch of RL step t is sampled with the
    # policy of step max(0, t - max_staleness); 0: synchronous, on policy.
    max_staleness: int = 0

    def describe_reward(self, fn_name: str) -> str:
        """What scores a completion, for the run's first line: reward.fn, or with an environment
        its step rewards (plus reward.fn with env_add_reward_fn)."""
        if self.agent:
            return f"agent {self.agent}" + (f" + {fn_name}" if self.env_add_reward_fn else "")
        if not self.env:
            return fn_name
        return f"environment {self.env}" + (f" + {fn_name}" if self.env_add_reward_fn else "")


@dataclass
class EvalSection(SamplingControls):
    """Held-out evaluation (trainer/evaluation/held_out.py): ``n_samples`` completions per prompt at
    ``temperature`` (0: greedy) with the controls of SamplingControls; with n_samples > 1 also
    mean@n, pass@k and maj@n, where a sample passes when its reward >= ``pass_threshold``.
    ``initial``: evaluate the starting model before training (a resumed run never does)."""

    n_samples: int = 1
    temperature: float = 0.0
    pass_threshold: float = 1.0
    initial: bool = True


@dataclass
class TrainerSection:
    """Steps, batch sizes, logging, checkpoints, output directory, resume."""

    sft_steps: int = 40
    rl_steps: int = 150
    sft_batch_size: int = 64
    prompts_per_step: int = 32
    eval_interval: int = 25
    log_interval: int = 1
    checkpoint_interval: int = 50
    keep_checkpoints: int = 2
    # Write checkpoints on a background thread while training goes on (engines/checkpoint/).
    async_checkpoint: bool = False
    output_dir: str = "outputs/run"
    resume: str = "auto"
    seed: int = 0
    progress: str = "auto"
    cpu_threads: int | None = 1
    dist_timeout_s: float = 600.0  # how long a collective waits for a silent peer rank
    plot: bool = True
    export: bool = True
    export_lora: str = "merged"  # with model.lora: the final export as merged weights or a peft adapter
    # Experiment tracking (trainer/tracking): where metrics go, and how the trackers name the run.
    logger: list | str = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "polyfsdp"
    experiment_name: str | None = None  # null: the output directory's name
    tags: list = field(default_factory=list)
    log_val_generations: int = 0  # per evaluation, this many prompts' completions as a table
    log_rollout_samples: int = 0  # per logged RL step, this many prompts' first completions as a table


@dataclass
class JobConfig:
    """Everything one run needs, validated."""

    backend: str
    model: ModelSection
    engine: EngineConfig
    patches: Any
    algo: AlgoSection
    data: DataSection
    trainer: TrainerSection
    raw: dict
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    eval: EvalSection = field(default_factory=EvalSection)
