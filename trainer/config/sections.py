"""The job configuration's sections as dataclasses: one per Hydra group the trainer owns
(``model``, ``data``, ``reward``, ``rollout``, ``eval``, ``trainer``; ``algo``'s are in
trainer/config/algo.py, ``engine``'s are the engine's own) and :class:`JobConfig`, all of them.

Each field is declared once here (``setting``: its default, what it means, its range); Hydra's
base option of each group is built from these defaults (trainer/config/composition.py), so
configs/*.yaml hold only presets and overrides. trainer/config/bounds.py converts the composed
config into these classes and checks types and ranges; trainer/config/job.py adds the checks
that span sections.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from polyfsdp.engines.config import ADAPTER_EXPORTS, EngineConfig, LoraConfig, ModelConfig, setting

from .algo import AlgoSection, check_choice, check_min
from .bounds import MAX_BATCH, MAX_SEED, MAX_TOKENS, WEEK_S, convert
from .sampling import SamplingControls
from ..data.images import DEFAULT_MAX_IMAGE_PIXELS, PIL_MAX_PIXELS
from ..errors import ConfigError
from ..rollout.servers.settings import ServerSettings, VllmSettings


# data.source's values, the built-in tasks, what happens to an overlong prompt; trainer.progress's modes.
DATA_SOURCES = ("builtin", "jsonl", "parquet", "files", "verifiers")
TASKS = ("reverse", "arith_words", "calculator", "count_squares")
OVERLONG_POLICIES = ("filter", "error", "truncate")
PROGRESS_MODES = ("auto", "bar", "lines", "off")


def file_list(key: str, value) -> list | None:
    """``data.train_files`` / ``val_files`` as a list (one path given as a string), or None."""
    if value is None:
        return None
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{key}: expected a list of file paths, e.g. {key}=[a.parquet,b.jsonl], got {value!r}")
    return files


@dataclass
class BackendSection:
    """The device backend (backends/registry.py)."""

    name: str = setting("auto", doc="auto (the first usable backend, backends/registry.py) or a backend's name "
                                    "(backend=OPTION lists them), which fails loudly if unusable")


@dataclass
class ModelSection:
    """A tiny preset (with Hugging Face config ``overrides``) or a local checkpoint ``path``."""

    preset: str | None = setting("qwen2-tiny", doc="a tiny model built from config (no download)")
    path: str | None = setting(None, doc="a local Hugging Face checkpoint (or .gguf file) instead of the preset")
    dtype: str = setting("float32", doc="float32 | bfloat16 (float16: use engine.param_dtype)")
    attn_implementation: str | None = setting(None, doc="null: the backend's choice")
    seed: int = setting(0, doc="the initial weights' seed (presets)", low=0, high=MAX_SEED)
    # The config builds one entry per layer, so num_hidden_layers=10**12 hangs before any check,
    # and a size below 1 fails deep in the model's construction. The upper ends are far beyond
    # the largest open models (126 layers, hidden 16384, 256k vocabularies, 10M positions).
    overrides: dict = setting({}, doc="Hugging Face config fields that replace the preset's (presets only)",
                              entries={"num_hidden_layers": (1, 4096), "vocab_size": (1, 2**24),
                                       "max_position_embeddings": (1, 2**30), "hidden_size": (1, 2**20),
                                       "intermediate_size": (1, 2**20), "num_attention_heads": (1, 2**20),
                                       "num_key_value_heads": (1, 2**20), "head_dim": (1, 2**20)})
    lora: LoraConfig = setting(LoraConfig, doc="LoRA adapters through peft")
    freeze_vision: bool = setting(False, doc="a vision-language model: freeze its vision tower but the merger "
                                  "(no gradients, not in the optimizer; docs/vision-language.md)")

    def model_config(self, vocab_size: int | None = None, path: str | None = None) -> ModelConfig:
        """The engine's ModelConfig: from ``path`` (given or configured) else the preset;
        a bad field raises naming it as ``model.<field>``."""
        path = path or self.path
        return ModelConfig.from_dict({"preset": None if path else self.preset, "path": path, "dtype": self.dtype,
                                      "attn_implementation": self.attn_implementation,
                                      "vocab_size": None if path else vocab_size, "seed": self.seed,
                                      "lora": dataclasses.asdict(self.lora), "freeze_vision": self.freeze_vision},
                                     where="model")


@dataclass
class DataSection:
    """Where prompts and answers come from: the built-in task or a local file."""

    source: str = setting("builtin", doc="builtin | jsonl | parquet | files | verifiers")
    task: str = setting("reverse", doc="data=builtin: reverse | arith_words | calculator | "
                                                "count_squares (a vision-language preset)")
    alphabet: str = setting("abcdefgh", doc="task=reverse: the letters of its strings")
    min_len: int = setting(3, doc="task=reverse: the shortest string", high=4096)
    max_len: int = setting(5, doc="task=reverse: the longest string", high=4096)
    path: str | None = setting(None, doc="data=jsonl / parquet: the file")
    prompt_key: str = setting("prompt", doc="a string, or a list of chat messages [{role, content}]")
    answer_key: str | None = setting(None, doc="dotted path; null: reward_model.ground_truth (verl), else answer")
    eval_size: int = setting(128, doc="held-out prompts (never used for training)", high=MAX_BATCH)
    train_files: list | str | None = setting(None, doc="[a.parquet,b.jsonl]: data=files reads these (JSONL or "
                                                       "parquet, by extension)")
    val_files: list | str | None = setting(None, doc="optional validation files; else the last eval_size "
                                                     "training records are held out")
    apply_chat_template: bool = setting(False, doc="also render string prompts with the tokenizer's chat template")
    max_prompt_length: int | None = setting(None, doc="tokens; null: only the model's max_position_embeddings "
                                                      "limits it", high=MAX_TOKENS)
    overlong: str = setting("filter", doc="prompts over max_prompt_length: filter (count printed) | error | "
                                          "truncate (keep the end)")
    max_image_pixels: int = setting(DEFAULT_MAX_IMAGE_PIXELS, doc="a record's image may hold this many pixels "
                                    "(width x height, read from its header before decoding); 4096x4096: above the "
                                    "12845056 that Qwen2-VL's and Qwen2.5-VL's processors keep (they scale larger "
                                    "images down)",
                                    low=1, high=PIL_MAX_PIXELS)
    allow_image_paths_outside: bool = setting(False, doc="image paths may name files outside the data file's "
                                                         "folder (absolute, ../, links out); false: refused "
                                                         "before they are opened")

    def check(self) -> None:
        """The data section's own checks: the source's keys together (ConfigError naming the key)."""
        check_choice("data.source", self.source, DATA_SOURCES)
        check_choice("data.overlong", self.overlong, OVERLONG_POLICIES)
        if self.max_prompt_length is not None:
            check_min("data.max_prompt_length", self.max_prompt_length, 1)
        if not self.prompt_key or (self.answer_key is not None and not self.answer_key):
            raise ConfigError("data.prompt_key / data.answer_key: expected a (dotted) field name, got an empty one")
        self.train_files = file_list("data.train_files", self.train_files)
        self.val_files = file_list("data.val_files", self.val_files)
        if self.source == "builtin" and (self.train_files or self.val_files):
            raise ConfigError("data.train_files/val_files: data=builtin does not read files; add data=files to train "
                              "on them")
        if self.source != "builtin" and self.train_files and self.path:
            raise ConfigError(f"data.path / data.train_files: give one of them, got both ({self.path!r} and "
                              f"{self.train_files})")
        if self.source == "files" and not self.train_files:
            raise ConfigError("data.train_files: data=files needs data.train_files=[FILE,...]")
        if self.source == "builtin":
            check_choice("data.task", self.task, TASKS)
            if not self.alphabet.isalpha():
                raise ConfigError(f"data.alphabet: expected letters, got {self.alphabet!r}")
            if not 1 <= self.min_len <= self.max_len:
                raise ConfigError(f"data.min_len/max_len: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
            if self.path is not None:
                raise ConfigError(f"data.path: data=builtin does not read a file, got data.path={self.path!r}; "
                                  f"add data=jsonl (or data=parquet) to train on it")
        elif self.source == "verifiers":
            if self.path or self.train_files or self.val_files:
                raise ConfigError("data.path/train_files/val_files: data=verifiers reads the tasks of rollout.agent's "
                                  "verifiers environment, not files")
        elif not self.path and not self.train_files:
            raise ConfigError(f"data.path: data={self.source} needs data.path=FILE")
        check_min("data.eval_size", self.eval_size, 1)


@dataclass
class RewardModelSection:
    """``reward.model``: a local reward-model checkpoint scoring prompt + completion
    (trainer/rewards/reward_model.py); ``path: null``: none. Its score, times ``weight``, is
    added to the reward of the records whose ``data_source`` is in ``data_sources`` (null: all)."""

    path: str | None = setting(None, doc="a local *ForSequenceClassification checkpoint (num_labels=1); "
                                         "null: no reward model")
    name: str = setting("model", doc="logged as reward/<name>")
    weight: float = setting(1.0, doc="its weight in the reward's sum", low=-1e3, high=1e3)
    data_sources: list | None = setting(None, doc="it scores only records of these data_source values; null: all")
    template: str = setting("auto", doc="auto (its tokenizer's chat template when it has one) | chat | none")
    value_head_path: str | None = setting(None, doc="a causal LM with this value head file instead of a classifier")
    max_tokens_per_batch: int | None = setting(None, doc="tokens per forward; null: "
                                                         "engine.max_tokens_per_micro_batch", low=1, high=2**24)
    offload: bool = setting(False, doc="keep its shards in host memory between forwards")


@dataclass
class RewardSection:
    """``reward.fn``: a built-in rule, ``path/to/file.py:fn`` or ``package.module:fn``
    (``auto``: the data's own rule; ``none``: no function, a reward model alone); ``kwargs`` are
    extra keyword arguments to it. ``weight`` and ``data_sources`` place it in the weighted sum
    of the reward's sources (trainer/rewards/sources.py), beside ``model``."""

    fn: str = setting("auto", doc="auto (the data's rule) | char_match | exact_match | gsm8k | math_boxed | "
                                  "path/to/file.py:function | package.module:function | none")
    kwargs: dict | None = setting(None, doc="extra keyword arguments to fn, e.g. reward.kwargs={tolerance:0.01}",
                                  entries={})
    timeout_s: float | None = setting(60.0, doc="seconds one reward call may take; null: no limit",
                                      low=0.001, high=WEEK_S)
    # A weight beyond 1e3 carries a bounded reward (1e9) past what group statistics keep exact.
    weight: float = setting(1.0, doc="reward.fn's weight in the sum of the sources", low=-1e3, high=1e3)
    data_sources: list | None = setting(None, doc="reward.fn scores only records of these data_source values; "
                                                  "null: all")
    model: RewardModelSection = setting(RewardModelSection, doc="a reward model")
    judge: dict | None = setting(None, doc="a generative judge's settings (trainer/rewards/judge.py), e.g. "
                                           "reward.judge={url:http://host:8000/v1}")


@dataclass
class RolloutSection:
    """Generation: ``engine`` samples (trainer/rollout/engines.py); ``unshard`` (auto | true |
    false) gathers the model once per rollout instead of once per layer per decoding step
    (trainer/rollout/generate.py); the rest is vLLM's (trainer/rollout/vllm.py)."""

    engine: str = setting("auto", doc="auto | builtin (our decoding loop) | hf (Hugging Face generate) | vllm "
                                      "(an engine per rank) | vllm_server (vLLM servers, docs/rollouts-and-servers.md)")
    unshard: bool | str = setting("auto", doc="gather the sharded model once per rollout: true | false (per "
                                              "layer per step) | auto (when it fits)")
    sync_bucket_mb: float = setting(64.0, doc="vllm: weights stream into vLLM in buckets of this size")
    check_sync: bool = setting(True, doc="vllm: compare vLLM's log-probs of a probe with the policy's after "
                                         "every sync")
    check_sync_tol: float = setting(1e-3, doc="... and stop beyond this difference (fp32: ~1e-6 when in sync)")
    vllm: VllmSettings = setting(VllmSettings, doc="engine=vllm and vllm_server: vLLM's own settings")
    server: ServerSettings = setting(ServerSettings, doc="engine=vllm_server: where the servers run")
    # Multi-turn (trainer/rollout/drivers/multi_turn.py): an environment plug-in and its limits.
    env: str | None = setting(None, doc="a built-in (calculator), path/to/file.py:Class or package.module:Class")
    env_kwargs: dict = setting({}, doc="keyword arguments of the environment's constructor")
    max_turns: int = setting(1, doc="assistant turns per conversation (each at most algo.actor.max_new_tokens)",
                             low=1, high=1024)
    max_total_tokens: int | None = setting(None, doc="prompt + every turn; null: the model's "
                                                     "max_position_embeddings", low=2, high=2**24)
    env_add_reward_fn: bool = setting(False, doc="add reward.fn of the last assistant turn to the environment's "
                                                 "rewards")
    env_timeout_s: float | None = setting(60.0, doc="seconds one reset()/step() call may take; null: no limit",
                                          low=0.001, high=WEEK_S)
    # Agents from any framework (trainer/rollout/drivers/agent.py): FILE.py:fn or module:fn, talking
    # to the engine through an OpenAI-compatible endpoint on loopback; instead of env.
    agent: str | None = setting(None, doc="fn(example, client) -> reward: path/to/file.py:fn, package.module:fn "
                                          "or verifiers:ENV_ID")
    agent_concurrency: int = setting(64, doc="agent conversations alive at once per rank", low=1, high=4096)
    # Asynchronous RL (trainer/algos/sample_ahead.py): the batch of RL step t is sampled with the
    # policy of step max(0, t - max_staleness); 0: synchronous, on policy.
    max_staleness: int = setting(0, doc="RL step t trains on samples of the policy of step t - max_staleness",
                                 low=0, high=64)

    def __post_init__(self) -> None:
        # A section built in Python may give vLLM's and the servers' settings as mappings.
        if isinstance(self.vllm, dict):
            self.vllm = convert(VllmSettings, self.vllm, "rollout.vllm")
        if isinstance(self.server, dict):
            self.server = convert(ServerSettings, self.server, "rollout.server")

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

    n_samples: int = setting(1, doc="completions per prompt; > 1 adds mean@n, pass@k and maj@n")
    temperature: float = setting(0.0, doc="0: greedy (then n_samples must be 1)")
    pass_threshold: float = setting(1.0, doc="a sample passes (pass@k) when its reward >= this")
    initial: bool = setting(True, doc="evaluate the starting model before training (a resumed run never does)")

    def check(self) -> None:
        """The evaluation's own checks (ConfigError naming the key)."""
        check_min("eval.n_samples", self.n_samples, 1)
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature: expected >= 0 (0: greedy), got {self.temperature}")
        if self.n_samples > 1 and self.temperature == 0:
            raise ConfigError(f"eval.n_samples={self.n_samples}: greedy completions (eval.temperature=0) are all the same; "
                              f"set eval.temperature>0 (self.g. 1.0) or eval.n_samples=1")
        self.validate_sampling("eval")
        if not isinstance(self.initial, bool):
            raise ConfigError(f"eval.initial: expected true or false, got {self.initial!r}")


@dataclass
class TrainerSection:
    """Steps, batch sizes, logging, checkpoints, output directory, resume."""

    sft_steps: int = setting(40, doc="SFT warm-up steps")
    rl_steps: int = setting(150, doc="RL steps")
    sft_batch_size: int = setting(64, doc="sequences per SFT step (all ranks together)", high=MAX_BATCH)
    prompts_per_step: int = setting(32, doc="RL prompts per step (all ranks together); x group_size completions",
                                    high=MAX_BATCH)
    eval_interval: int = setting(25, doc="RL steps between held-out evaluations (0: only at phase ends)")
    log_interval: int = setting(1, doc="steps between logged records")
    checkpoint_interval: int = setting(50, doc="steps between checkpoints (0: none)")
    keep_checkpoints: int = setting(2, doc="checkpoints kept per phase")
    # Off by default: on a small CPU the write competes with the next step for the cores, which
    # wins back little (docs/checkpoints-and-resume.md, "Checkpoints and export").
    async_checkpoint: bool = setting(False, doc="write each checkpoint on a background thread")
    output_dir: str = setting("outputs/run", doc="where the run writes (the shipped preset: outputs/<now>)")
    resume: str = setting("auto", doc="auto (newest checkpoint in output_dir, if any) | never | PATH")
    seed: int = setting(0, doc="the run's seed", low=0, high=MAX_SEED)
    progress: str = setting("auto", doc="auto (bar on a terminal, lines otherwise) | bar | lines | off")
    # The tiny default model gains nothing from more, and on a busy host idle-spinning threads cost 5-10x.
    cpu_threads: int | None = setting(1, doc="host threads per rank (torch.set_num_threads); null: torch's "
                                             "default", high=4096)
    # A peer that stays silent longer than a week is gone.
    dist_timeout_s: float = setting(600.0, doc="how long a collective waits for a silent peer rank",
                                    low=1, high=WEEK_S)
    plot: bool = setting(True, doc="write curves.png")
    export: bool = setting(True, doc="write a Hugging Face checkpoint (+ tokenizer) to output_dir/final")
    export_lora: str = setting("merged", doc="with model.lora.rank > 0: merged (plain HF weights) | adapter "
                                             "(peft adapter dir)")
    # Experiment tracking (trainer/tracking): where metrics go, and how the trackers name the run.
    logger: list | str = setting(["console", "jsonl"], doc="console | jsonl (always) | tensorboard | wandb | "
                                                           "mlflow")
    project_name: str = setting("polyfsdp", doc="the trackers' project (W&B project, MLflow experiment)")
    experiment_name: str | None = setting(None, doc="the run's name in the trackers; null: the output "
                                                    "directory's name")
    tags: list = setting([], doc="the run's tags in W&B and MLflow")
    log_val_generations: int = setting(0, doc="per evaluation, N (prompt, completion, ground truth, reward) rows "
                                              "to generations.jsonl and the trackers")
    log_rollout_samples: int = setting(0, doc="per logged RL step, the first completion of N of its prompts")

    def check(self) -> None:
        """The trainer section's own checks (ConfigError naming the key)."""
        from ..tracking import check_loggers  # the trackers' registry: only when checking

        for key in ("sft_steps", "rl_steps", "eval_interval", "checkpoint_interval"):
            check_min(f"trainer.{key}", getattr(self, key), 0)
        for key in ("sft_batch_size", "prompts_per_step", "log_interval", "keep_checkpoints"):
            check_min(f"trainer.{key}", getattr(self, key), 1)
        check_choice("trainer.progress", self.progress, PROGRESS_MODES)
        check_choice("trainer.export_lora", self.export_lora, ADAPTER_EXPORTS)
        self.logger = check_loggers(self.logger)
        check_min("trainer.log_val_generations", self.log_val_generations, 0)
        check_min("trainer.log_rollout_samples", self.log_rollout_samples, 0)
        if not isinstance(self.tags, list) or not all(isinstance(tag, str) and tag for tag in self.tags):
            raise ConfigError(f"trainer.tags: expected a list of names, e.g. trainer.tags=[baseline,lr1e-6], "
                              f"got {self.tags!r}")
        if self.cpu_threads is not None:
            check_min("trainer.cpu_threads", self.cpu_threads, 1)
        if self.resume not in ("auto", "never") and not os.path.isdir(self.resume):
            raise ConfigError(f"trainer.resume: expected auto, never or an existing checkpoint directory, "
                              f"got {self.resume!r}")


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
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
