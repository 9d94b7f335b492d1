"""``polyfsdp-train``: the Hydra-configured entry point (also ``python -m polyfsdp.trainer.train``).

With no arguments it runs the default job (SFT warm-up + RL (GRPO) on the built-in task, CPU
minutes). Arguments are Hydra overrides (``engine.pad_mode=left_right``, ``model=llama``,
``model.path=DIR``); under ``torchrun --nproc_per_node N`` every rank runs this. The
config is composed with Hydra's compose API rather than ``@hydra.main``: no working
directory change, no Hydra log files, and every configuration mistake is one line.
"""
from __future__ import annotations

import errno
import logging
import os
import sys

from .startup import (EXIT_INTERRUPTED, EXIT_TERMINATED, SigtermWhileStarting, TerminatedWhileStarting,
                      interrupted_while_starting, rank_prefix, terminated_while_starting)

USAGE = """usage: polyfsdp-train [GROUP=OPTION] [KEY=VALUE ...] [--cfg] [--estimate] [--help]

Runs SFT warm-up then RL (GRPO) on the built-in task (defaults), or what the overrides say.
  --cfg      print the composed configuration and exit (also Hydra's --cfg job)
  --estimate print the job's per-rank memory, phase by phase (SFT update, RL rollout
             with its KV cache, log-prob passes, critic, updates) and its peak, and exit;
             nothing is built on a device (WORLD_SIZE sets the ranks)
  --help     this text
Config groups (pick with GROUP=OPTION):
{groups}
RL choices (registered; docs: docs/config-reference.md, docs/algorithms.md):
  algo.adv_estimator   {estimators}, or path/to/file.py:NAME / package.module:NAME
  algo.actor.policy_loss {losses}, or path/to/file.py:NAME / package.module:NAME
Examples:
  polyfsdp-train
  polyfsdp-train trainer.rl_steps=50 engine.pad_mode=left_right
  polyfsdp-train task=calculator          # tool calls: SFT on demonstrations, then RL with the environment
  polyfsdp-train model.path=/path/to/hf_checkpoint data=jsonl data.path=train.jsonl
  polyfsdp-train model.path=DIR data=files data.train_files=[a.parquet] reward.fn=my_reward.py:compute_score
  torchrun --nproc_per_node 2 -m polyfsdp.trainer.train trainer.output_dir=runs/a
  polyfsdp-train trainer.output_dir=runs/a trainer.resume=auto   # continue a stopped run
"""

# Errors a user causes before training starts: printed as one line, exit status 2.
EXIT_USAGE = 2
__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "main"]
# A full disk or quota: one line saying so, whichever file was being written (metrics are
# appended whole, checkpoints and the export leave no partial directory behind).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXT = "No space left on device"


def _rank() -> int:
    """torchrun's rank for logging and error lines (the process group may not exist yet)."""
    from polyfsdp.backends.topology import launch_env

    try:
        return launch_env().rank
    except ValueError:
        return 0


def _setup_logging() -> None:
    level = logging.INFO if _rank() == 0 else logging.WARNING
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("polyfsdp.trainer").setLevel(level)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        # Per-load/save progress bars would bury the job's own progress lines.
        hf_logging.disable_progress_bar()
    except ImportError:  # transformers is a dependency; its logging helper may move
        pass


def _error(exc: BaseException, prog: str = "polyfsdp-train") -> int:
    from .errors import RankError  # torch-free, like every error class (trainer/errors.py)

    if isinstance(exc, RankError) and _rank() != 0:
        return EXIT_USAGE  # every rank has it: rank 0 prints the one line
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(rank_prefix(_rank(), prog) + message, file=sys.stderr, flush=True)
    return EXIT_USAGE


def _interrupted_line(job, how: str = "interrupted") -> str:
    where = f"after {job.position[0]} step {job.position[1]}" if job.position else "before the first step"
    last = f"last checkpoint {job.checkpoints.last}" if job.checkpoints.last else "no checkpoint yet"
    return f"{how} {where}; {last}"


def _say_stop(line: str) -> None:
    """Print a stop line on stderr; if that pipe is gone (``| tee log`` dies with the same Ctrl-C),
    on the terminal instead, and send what is left of the output nowhere, so the exit status
    stays the stop's own rather than a broken pipe's."""
    try:
        print(line, file=sys.stderr, flush=True)
        return
    except OSError:  # BrokenPipeError, or a closed terminal
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.dup2(devnull, sys.stderr.fileno())
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:  # no controlling terminal (a batch job): nothing can show it
        pass


def _usage() -> str:
    from .config.composition import GROUPS, PRESET_GROUPS, available_options
    from .algos.rl_choices import ESTIMATOR_NAMES, POLICY_LOSS_NAMES
    from .config.reference import help_text

    groups = "\n".join(f"  {g:<8} {', '.join(available_options(g))}" for g in GROUPS + PRESET_GROUPS)
    usage = USAGE.format(groups=groups, estimators=", ".join(ESTIMATOR_NAMES), losses=", ".join(POLICY_LOSS_NAMES))
    return usage + help_text()


# Hydra's own spelling is ``--cfg job`` (or all/hydra): accepted, so Hydra habits work.
CFG_FLAGS = ("--cfg", "-c")
CFG_VALUES = ("job", "all")


def _take_cfg_flag(args: list[str]) -> tuple[bool, list[str]]:
    """(whether to print the config, the remaining overrides): ``--cfg``, ``--cfg job``,
    ``--cfg=all``; a Hydra section this entry point does not have is one ConfigError."""
    from .errors import ConfigError

    show, rest, i = False, [], 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if arg in CFG_FLAGS or (eq and name in CFG_FLAGS):
            show = True
            if not eq and i + 1 < len(args) and args[i + 1] in (*CFG_VALUES, "hydra"):
                i, value = i + 1, args[i + 1]
            if value and value not in CFG_VALUES:
                raise ConfigError(f"--cfg {value}: polyfsdp-train composes no Hydra section of its own; "
                                  f"--cfg (or --cfg job) prints the job's configuration")
        else:
            rest.append(arg)
        i += 1
    return show, rest


def main(argv: list[str] | None = None) -> int:
    """Parse overrides, validate, run the job; returns the process exit status."""
    with SigtermWhileStarting() as starting:
        try:
            return _main(argv, starting)
        except KeyboardInterrupt:
            # Ctrl-C while torch and transformers load, or while the job is set up (the run
            # itself catches its own, to say how to continue).
            return interrupted_while_starting().code
        except TerminatedWhileStarting:
            return terminated_while_starting().code


def _known_failure(exc: BaseException) -> str | None:
    """The one line for a failure outside the user's config: a full disk, or a peer rank that
    died or stopped answering (every surviving rank says which); None for anything else."""
    from polyfsdp.backends.distributed import collective_failure

    fix = "free some space (or choose another trainer.output_dir) and resume"
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}; {fix}"
    text = " ".join(str(exc).split())
    if DISK_FULL_TEXT in text:
        # safetensors' own error for a failed write (its message carries the OS's words).
        return f"{DISK_FULL_TEXT} ({type(exc).__name__}: {text[:160]}); {fix}"
    return collective_failure(exc)


def _main(argv: list[str] | None, starting: SigtermWhileStarting) -> int:
    # Until the overrides have composed, only Hydra is imported: --help, a mistyped key or option
    # and a value outside its bounds answer in about a second, not after torch and transformers load.
    from .config.composition import compose, to_container
    from .errors import ConfigError
    from .config.bounds import check_bounds

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(_usage())
        return 0
    try:
        show_cfg, overrides = _take_cfg_flag(args)
    except ConfigError as exc:
        return _error(exc)
    estimate = "--estimate" in overrides
    overrides = [a for a in overrides if a != "--estimate"]
    unknown_flags = [a for a in overrides if a.startswith("-")]
    if unknown_flags:
        return _error(ConfigError(f"unknown option {unknown_flags[0]!r}; arguments are KEY=VALUE overrides "
                                  f"(see --help)"))
    try:
        raw = to_container(compose(overrides))
        check_bounds(raw)
    except ConfigError as exc:
        return _error(exc)
    _setup_logging()
    from polyfsdp.backends import BackendUnavailableError
    from polyfsdp.backends.distributed import destroy_distributed

    from .config.job import build_job_config
    from .errors import DataError, MetricsWriteError, Preempted, RankError
    from .network_waits import StoppedWhileWaiting
    from .run.stop import continue_command
    from polyfsdp.engines.checkpoint import CheckpointError

    # CheckpointError: a save that failed (full disk, unwritable output); a damaged checkpoint
    # to resume from is already a ConfigError naming trainer.resume. RankError: one rank's error.
    user_errors = (ConfigError, DataError, BackendUnavailableError, CheckpointError, RankError, MetricsWriteError)
    import torch.distributed as dist

    # Tear down only a process group this call created (an embedding process may own one).
    owned_group = not dist.is_initialized()
    try:
        from polyfsdp.backends.topology import launch_env

        world_size = launch_env().world_size
        cfg = build_job_config(raw, world_size=world_size)
        if show_cfg:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.create(cfg.raw)), end="")
            return 0
        from .config.machine_fit import check_fits
        from .run.estimate import print_estimate

        if estimate:
            print_estimate(cfg, world_size)
            return 0
        check_fits(cfg, world_size)  # before any work: a job this machine cannot hold is one line
        from .run.job import Job

        job = Job(cfg)
    except user_errors as exc:
        return _error(exc)
    except Exception as exc:
        line = _known_failure(exc)
        if line is None:
            raise
        return _error(ConfigError(line))
    finished = False
    starting.job_starts()
    # The job's SIGTERM flag stays installed until the failure below is reported: a launcher that saw
    # a peer rank die sends SIGTERM to the survivors, and its default action would end this rank
    # while it looks for the lost peer, before it said which one.
    with job.stop:
        try:
            job.run()
            finished = True
        except user_errors as exc:
            return _error(exc)
        except Preempted as exc:
            finished = True  # every rank stopped at the same step boundary
            if _rank() == 0:
                _say_stop(f"polyfsdp-train: {exc}; continue with: {continue_command(overrides, job.out, world_size)}")
            return EXIT_TERMINATED
        except StoppedWhileWaiting as exc:
            # A SIGTERM while the main thread waited on a network peer (a judge not answering): it
            # stops now, without the step's checkpoint (saving needs every rank, which the peer may hold up).
            if _rank() == 0:
                _say_stop(f"polyfsdp-train: {_interrupted_line(job, str(exc))}; continue with: "
                          f"{continue_command(overrides, job.out, world_size)}")
            return EXIT_TERMINATED
        except (KeyboardInterrupt, BrokenPipeError) as exc:
            # Ctrl-C is how runs are stopped (and a closed output pipe stops it too): say how to
            # continue instead of a traceback.
            if _rank() == 0:
                cause = "" if isinstance(exc, KeyboardInterrupt) else " (the output pipe closed)"
                _say_stop(f"polyfsdp-train: {_interrupted_line(job)}{cause}; continue with: "
                          f"{continue_command(overrides, job.out, world_size)}")
            return EXIT_INTERRUPTED
        except Exception as exc:
            line = _known_failure(exc)
            if line is None:
                raise
            return _error(ConfigError(line))
        finally:
            if owned_group:
                destroy_distributed(wait_for_peers=finished)
    return 0


if __name__ == "__main__":
    sys.exit(main())
