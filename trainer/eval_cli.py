"""``polyfsdp-eval``: evaluate a Hugging Face model directory (a run's ``final/`` export, or
any local checkpoint) or a training checkpoint of a run (``OUTPUT_DIR/checkpoints/sft|rl[/step_N]``)
on held-out data with a reward function, the way ``polyfsdp-train`` evaluates
(trainer/evaluation/held_out.py); prints a table and writes JSON: by default next to what it evaluated
(:func:`default_json_path`), never over the results of another model.

The data, reward and eval keys are polyfsdp-train's. For a run's export (a directory next to
the run's ``config.yaml``) they default to that run's, so ``polyfsdp-eval runs/a/final``
scores the same held-out prompts the run did; overrides change them (``eval.n_samples=8
eval.temperature=1.0``, ``data=files data.val_files=[test.jsonl]``). Under ``torchrun`` every
rank evaluates its share and rank 0 prints.

A run directory may be someone else's, so its config.yaml is data (trainer/config/saved_run.py):
its ``${...}`` stay literal strings, and code it names (``reward.fn=FILE.py:NAME`` ...) is
imported only when the user names it on the command line or passes ``--trust-run-code``. Its
relative paths are read from the directory the run started in (trainer/config/run_start.py), the
command line's from the working directory.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .config.composition import GROUPS, compose, to_container
from .config.run_start import resolve_saved_paths
from .config.saved_run import TRUST_FLAG, apply_overrides, load_saved_config, parse_overrides, refuse_saved_code
from .errors import ConfigError
from .rollout.row_seeds import step_seed

PROG = "polyfsdp-eval"
USAGE = """usage: polyfsdp-eval MODEL_DIR [KEY=VALUE ...] [--json FILE] [--trust-run-code]

Evaluates the Hugging Face model in MODEL_DIR (or a run's checkpoint) on the held-out prompts
of the data config (a run's export or checkpoint: that run's data, reward and eval settings
unless overridden; its config.yaml is read as data, ${...} left unresolved).
  --json FILE  where to write the results (default: a run's RUN/eval/<what>.json, e.g.
               runs/a/eval/final.json; outside a run MODEL_DIR.eval.json next to it); a file
               holding another model's results is never overwritten
  --trust-run-code  import the code the run's config.yaml names (reward.fn, rollout.env,
               algo.adv_estimator, algo.actor.policy_loss as FILE.py:NAME or module:NAME);
               without it such a key is refused unless given on the command line
Examples:
  polyfsdp-eval runs/a/final
  polyfsdp-eval runs/a/final eval.n_samples=8 eval.temperature=1.0
  polyfsdp-eval runs/a/checkpoints/rl/step_000050
  polyfsdp-eval my_model data=files data.train_files=[train.jsonl] data.val_files=[test.jsonl] reward.fn=gsm8k
"""
# A run's evaluations go to RUN/<EVAL_DIR>/; a model outside a run gets MODEL_DIR<JSON_SUFFIX>.
EVAL_DIR = "eval"
JSON_SUFFIX = ".eval.json"


# A run's phases (trainer/run/resume.py's PHASES), and the RL phase's old name (LEGACY_RL_PHASE):
# an old run's checkpoints still evaluate. Literal here: resume.py imports torch, --help must not.
TRAINING_PHASES = ("sft", "rl", "grpo")


@dataclass
class ModelToEvaluate:
    """Where the weights come from: ``weights`` (a Hugging Face directory), then, for a
    training checkpoint, ``checkpoint`` of ``phase`` loaded into them; ``run_dir``: the
    polyfsdp-train run it belongs to (None: a model outside any run)."""

    weights: Path
    run_dir: Path | None = None
    checkpoint: Path | None = None
    phase: str = "sft"

    @property
    def evaluated(self) -> Path:
        """What the numbers belong to: the checkpoint loaded, else the model directory."""
        return self.checkpoint or self.weights

    def label(self, rl_run: bool) -> str:
        """What the model is, for the lines the engine prints (``rl_run``: the run had an RL phase,
        so its ``final/`` export is the RL policy)."""
        if self.checkpoint is not None:
            return f"{'sft' if self.phase == 'sft' else 'rl'} policy"
        if self.run_dir is None:
            return "evaluated model"
        return {"init_model": "initial model", "sft_model": "sft policy"}.get(
            self.weights.name, "rl policy" if rl_run else "sft policy")


def default_json_path(model: ModelToEvaluate) -> Path:
    """Where the results go without ``--json``: in a run, ``RUN/eval/`` named after what was
    evaluated (``final.json``, ``checkpoints_rl_step_000050.json``); outside one, next to the
    model directory (``my_model.eval.json``). Never the working directory, where every model's
    results would land in one file."""
    if model.run_dir is None:
        return model.weights.with_name(model.weights.name + JSON_SUFFIX)
    try:
        name = "_".join(model.evaluated.relative_to(model.run_dir).parts)
    except ValueError:  # a checkpoint linked in from other storage
        name = model.evaluated.name
    return model.run_dir / EVAL_DIR / (name + ".json")


def check_run_json_target(path: Path) -> None:
    """A ConfigError when ``path`` (a run's default results file, RUN/eval/NAME.json) or its folder
    is a symbolic link, or ``path`` is not a regular file: a run directory may be crafted, and a
    link would aim the write (or the read of earlier results) at any file of the reader's, a FIFO
    would block that read forever."""
    for where in (path.parent, path):
        if where.is_symlink():
            raise ConfigError(f"{where}: a symbolic link (to {os.readlink(where)}); refused: polyfsdp-eval writes a "
                              f"run's results only inside it; remove the link or name the file with --json FILE")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path}: not a regular file; refused: name the results file with --json FILE")


def check_json_target(path: Path, model: ModelToEvaluate) -> None:
    """A ConfigError unless ``path`` is free or holds earlier results of this same model: the
    results of another model (or any other file) are not overwritten."""
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text()).get("evaluated")
    except (OSError, ValueError, AttributeError):
        previous = None
    if previous != str(model.evaluated):
        held = f"the results of {previous}" if previous else "a file that is not this model's results"
        raise ConfigError(f"--json {path}: it holds {held}; name another file with --json FILE or remove it")


def _run_dir(directory: Path) -> Path | None:
    return directory if (directory / "config.yaml").is_file() and (directory / "metrics.jsonl").is_file() else None


def locate_model(path: Path) -> ModelToEvaluate:
    """What ``polyfsdp-eval PATH`` evaluates: a run's checkpoint (``checkpoints/<phase>`` means
    its newest), or a Hugging Face directory (in a run, such as ``final/``, or not)."""
    from polyfsdp.engines.checkpoint import CheckpointError, latest_checkpoint

    phase_dir = path if path.name in TRAINING_PHASES else path.parent
    if phase_dir.name in TRAINING_PHASES and phase_dir.parent.name == "checkpoints":
        run_dir = _run_dir(phase_dir.parent.parent)
        if run_dir is None:
            raise ConfigError(f"MODEL_DIR {str(path)!r}: a checkpoint outside a polyfsdp-train run directory (no "
                              f"config.yaml and metrics.jsonl in {phase_dir.parent.parent})")
        try:
            checkpoint = path if path != phase_dir else latest_checkpoint(phase_dir)
        except CheckpointError as exc:  # a crafted latest naming a directory outside the run: one line
            raise ConfigError(f"MODEL_DIR {str(path)!r}: {exc}") from None
        if checkpoint is None:
            raise ConfigError(f"MODEL_DIR {str(path)!r}: no complete checkpoint in it")
        # The phase's starting model (shape, tokenizer) takes the checkpoint's weights.
        after_sft = phase_dir.name != "sft" and (run_dir / "sft_model").is_dir()
        start = run_dir / ("sft_model" if after_sft else "init_model")
        return ModelToEvaluate(start, run_dir, checkpoint, phase_dir.name)
    return ModelToEvaluate(path, _run_dir(path.parent))


def eval_config(model: ModelToEvaluate, overrides: list[str], world_size: int = 1, trust_run_code: bool = False,
                say=print):
    """The JobConfig to evaluate ``model`` with: its run's config (or the defaults) with
    ``overrides`` applied; ``model.path`` is the directory the weights come from. The run's
    config is data (config/saved_run.py): code it names is refused unless ``trust_run_code``.
    Its relative paths are read from where the run started (config/run_start.py; ``say``: the
    line when that is not known here), the overrides' from the working directory."""
    from .config.job import build_job_config

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"{bad[0]!r}: expected KEY=VALUE (see --help)")
    weights = model.weights
    if model.run_dir is None:
        raw = to_container(compose([*overrides, f"model.path={weights}"]))
    else:
        raw = load_saved_config(model.run_dir / "config.yaml")
        if isinstance(raw.get("trainer"), dict):
            # Evaluating continues no run: the checkpoint the run was resumed from (relative to where it
            # started, or pruned since) is no concern of ours, and its check would refuse the run.
            raw["trainer"]["resume"] = "never"
        given_keys = [o.partition("=")[0] for o in overrides]
        # Before the overrides: a path the user types is relative to the user's own directory.
        raw = resolve_saved_paths(raw, model.run_dir, given_keys, trust_run_code, say)
        groups = {o.partition("=")[0] for o in overrides if o.partition("=")[0] in GROUPS}
        given = {}  # what the command line sets: the only code imported without --trust-run-code
        for group in groups:
            # A group choice (data=files): that option's section, composed as polyfsdp-train would.
            mine = [o for o in overrides if o.partition("=")[0] == group or o.startswith(group + ".")]
            given[group] = raw[group] = to_container(compose(mine))[group]
        keys = [o for o in overrides if o.partition("=")[0] not in groups and o.split(".")[0] not in groups]
        given.update(parse_overrides(keys))
        raw = apply_overrides(raw, given)
        refuse_saved_code(raw, given, model.run_dir / "config.yaml", trust_run_code)
        if model.checkpoint is not None and raw["model"].get("path") and (model.phase == "sft" or
                                                                         not raw["trainer"].get("sft_steps")):
            weights = Path(raw["model"]["path"])  # the run started from this local model, not init_model/
        raw["model"]["path"] = str(weights)
    return build_job_config(raw, world_size=world_size)


def _table(metrics: dict[str, float]) -> str:
    width = max(len(k) for k in metrics)
    return "\n".join(f"{key:<{width}}  {value:.4f}" for key, value in metrics.items())


def _take_json_flag(args: list[str]) -> tuple[str | None, list[str]]:
    path, rest, i = None, [], 0
    while i < len(args):
        if args[i] == "--json" and i + 1 < len(args):
            path, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--json="):
            path = args[i].partition("=")[2]
        else:
            rest.append(args[i])
        i += 1
    return path, rest


def evaluate_model(model_dir: Path, overrides: list[str], json_path: str | None, trust_run_code: bool = False) -> dict:
    """Build the engine on ``model_dir``, evaluate, print (rank 0) and write the JSON (to
    ``json_path``, default :func:`default_json_path`); returns it. ``trust_run_code``: import
    the code the run's config.yaml names (:func:`eval_config`)."""
    from polyfsdp.backends.distributed import current_rank
    from polyfsdp.backends.topology import launch_env

    from .config.machine_fit import check_eval_fits
    from .evaluation.held_out import GENERATION_COLUMNS, EvalSettings, evaluate
    from .run.job import Job
    from .run.resume import load_resume_checkpoint

    if not model_dir.is_dir():
        raise ConfigError(f"MODEL_DIR {str(model_dir)!r} is not a directory (a Hugging Face model such as a run's "
                          f"final/, or a run's checkpoints/rl/step_N)")
    if (model_dir / "adapter_config.json").is_file() and not (model_dir / "config.json").is_file():
        # trainer.export_lora=adapter writes only the adapters; the run's checkpoints hold base and adapters.
        run_dir = _run_dir(model_dir.parent) or "RUN"
        raise ConfigError(f"MODEL_DIR {str(model_dir)!r} holds LoRA adapters only (trainer.export_lora=adapter): "
                          f"evaluate the run's checkpoint instead (polyfsdp-eval {run_dir}/checkpoints/rl)")
    model = locate_model(model_dir)
    launch = launch_env()
    cfg = eval_config(model, overrides, world_size=launch.world_size, trust_run_code=trust_run_code,
                      say=lambda line: print(line, flush=True) if launch.rank == 0 else None)
    target = Path(json_path) if json_path is not None else default_json_path(model)
    if json_path is None and model.run_dir is not None:
        check_run_json_target(target)
    check_json_target(target, model)  # before the model is built: a refusal costs nothing
    check_eval_fits(cfg, launch.world_size)  # as polyfsdp-train's check_fits: what this machine cannot hold
    job = Job(cfg)  # the trainer's tokenizer, data, reward and checks; nothing is written
    engine = job._engine(model.phase, cfg.model.path, label=model.label(rl_run=cfg.algo.rl))
    if model.checkpoint is not None:
        load_resume_checkpoint(engine, model.checkpoint)
    e = cfg.eval
    settings = EvalSettings.of(e, seed=step_seed(cfg.trainer.seed, 0), rows=cfg.trainer.log_val_generations)
    try:
        result = evaluate(engine, job.tokenizer, job.source.eval_examples, job.eval_tokens, job.scorer, settings,
                          driver=job.driver)
    finally:
        job.driver.engine.close()
    metrics = {"reward": result.reward, **result.metrics}
    report = {"model": str(model_dir), "evaluated": str(model.evaluated), "num_prompts": len(job.source.eval_examples),
              "data": cfg.raw["data"], "reward_fn": job.scorer.name,
              "eval": {**cfg.raw.get("eval", {}), "sampling": settings.describe()}, "metrics": metrics,
              "generations": [dict(zip(GENERATION_COLUMNS, row)) for row in result.rows]}
    if current_rank() == 0:
        print(f"{PROG}: {model_dir} on {report['num_prompts']} held-out prompts ({cfg.data.source} data, reward "
              f"{cfg.rollout.describe_reward(job.scorer.name)}, {settings.describe()})")
        print(_table(metrics))
        try:
            if json_path is None:
                target.parent.mkdir(exist_ok=True)  # RUN/eval/; the run's own directory exists
            target.write_text(json.dumps(report, indent=1))
        except OSError as exc:
            raise ConfigError(f"--json {target}: cannot write it: {exc.strerror or exc}") from None
        print(f"results: {target}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """Parse, evaluate; returns the process exit status (user errors: one line, status 2)."""
    from polyfsdp.backends import BackendUnavailableError
    from polyfsdp.backends.distributed import destroy_distributed

    from .errors import DataError, RankError
    from .train import _error, _setup_logging

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or "-h" in args or "--help" in args:
        print(USAGE)
        return 0 if args else 2
    json_path, args = _take_json_flag(args)
    trust_run_code = TRUST_FLAG in args
    args = [a for a in args if a != TRUST_FLAG]
    if not args:
        return _error(ConfigError("MODEL_DIR is missing (see --help)"), PROG)
    if args[0].startswith("-") or "=" in args[0]:
        return _error(ConfigError(f"the first argument is MODEL_DIR, got {args[0]!r} (see --help)"), PROG)
    _setup_logging()
    import torch.distributed as dist

    owned_group, status = not dist.is_initialized(), 0
    try:
        evaluate_model(Path(args[0]).resolve(), args[1:], json_path, trust_run_code=trust_run_code)
    except (ConfigError, DataError, BackendUnavailableError, RankError) as exc:
        status = _error(exc, PROG)
    if owned_group:
        destroy_distributed(wait_for_peers=status == 0)  # after an error a peer may never arrive
    return status


if __name__ == "__main__":
    sys.exit(main())
