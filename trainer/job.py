"""The training job: SFT warm-up, then RL, with evaluation, checkpoints and resume.

Output directory layout::

    config.yaml          the resolved configuration
    metrics.jsonl        one record per step / evaluation (rank 0)
    generations.jsonl    trainer.log_val_generations: the first prompts' completions at each evaluation
    init_model/          the preset's starting weights + tokenizer (presets only)
    checkpoints/sft/     engine checkpoints of the SFT phase (step_*/, latest)
    checkpoints/rl/      engine checkpoints of the RL phase; with a critic estimator (algo=ppo) each
                         holds the actor and the critic (its part "critic") as one unit
    sft_model/           the SFT-end weights: the RL phase's starting point and its KL reference
    final/               Hugging Face export of the trained model + tokenizer
    curves.png           rewards, losses, KL, entropy, lengths, clip fraction, step time (redrawn at each evaluation)
    trackers.json        trainer.logger's tracker run ids (a resumed run reopens them)
    tensorboard/ wandb/ mlflow.db mlartifacts/   the trackers' own files (trainer.logger)

Every batch and every sampling seed is a function of the step, and each checkpoint stores
how many metrics records precede it, so ``trainer.resume=auto`` continues the same curve.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from omegaconf import OmegaConf

from polyfsdp.backends.distributed import all_reduce_max, barrier, broadcast_object, current_rank, init_distributed
from polyfsdp.backends.topology import topology
from polyfsdp.backends.registry import get_backend
from polyfsdp.engines.checkpoint import CheckpointError, PendingCheckpoint, checkpoint_parts
from polyfsdp.engines.checkpoint_files import remove_path
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.lora import AdaptersOff
from polyfsdp.engines.losses import SFTLoss

from .chat import PromptEncoder, check_position_budget, model_max_positions
from .config import ConfigError, JobConfig
from .data import RL_DATA_STREAM, build_source, check_generation_budget, check_tokenizer_covers, max_answer_tokens
from .evaluation import GENERATION_COLUMNS, EvalSettings, evaluate
from .generations_log import GENERATIONS_FILE, GenerationsLog
from .metrics import METRICS_FILE, MetricsLogger
from .model_init import write_initial_model
from .progress import Progress
from .rank_errors import check_same_data, on_every_rank
from .rewards import build_scorer
from .rl_step import rl_step
from .rollout_engines import build_rollout_engine
from .row_seeds import RowSeeds
from .resume import RL_PHASE, STATE_FILE, ResumePoint, check_same_run, find_resume, load_resume_point
from .sft import sft_step
from .stop import Preempted, StopRequest
from .task import TOKENIZER_FILE, load_tokenizer
from .tracking import RunInfo, Trackers, TrackerStartError, start_trackers

logger = logging.getLogger(__name__)

CHECKPOINT_MARKER = "checkpoint saved:"
CURVES_FILE = "curves.png"
CRITIC_PART = "critic"  # a critic estimator's value model: its name in the RL phase's checkpoints
# Where a polyfsdp before one-unit PPO checkpoints kept the critic's (checkpoints/critic/step_N).
LEGACY_CRITIC_DIR = "critic"
CRITIC_HEAD_FILE = "value_head.safetensors"  # final/: the critic's head (ModelConfig.value_head_path)
# The share of ln(vocabulary) (the uniform distribution's entropy) from which a rollout counts as
# sampled at random (Job._warn_if_sampling_is_flat).
FLAT_ENTROPY_SHARE = 0.9


def _say(message: str) -> None:
    """A progress line on rank 0's stdout (flushed: tests and log tailers read it live);
    above a live progress bar when one is showing."""
    if current_rank() == 0:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


@dataclass
class Phase:
    """What differs between the SFT and RL phases; :meth:`Job._run_phase` runs either."""

    name: str                 # "sft" | "rl": checkpoints/<name>/, metrics records
    stream: str               # the data stream its examples are drawn from (source.batch)
    steps: int                # the phase's optimizer steps
    batch_size: int           # examples drawn per step, over all ranks
    step_offset: int          # global step of the phase's start
    start_dir: str            # the model the phase starts from
    end_tag: str              # the evaluation at its end ("after_sft" or "final")
    export_dir: Path | None   # where its end model is exported (None: not exported)
    export_state: bool        # write the metrics position with the export (the RL phase's starting point)
    mid_evaluations: bool     # evaluate every trainer.eval_interval steps


class Job:
    """One run of ``polyfsdp-train`` (every rank builds one)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        if cfg.trainer.cpu_threads is not None:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        self.backend = get_backend(cfg.backend)
        init_distributed(self.backend, timeout_s=cfg.trainer.dist_timeout_s, sp_size=cfg.engine.ulysses_sp_size)
        # Ranks, data-parallel replicas and SP groups: asked here, never recomputed (backends/topology.py).
        self.topo = topology()
        self.rank, self.world = self.topo.rank, self.topo.world_size
        # Rank 0's output_dir wins: "${now:...}" may resolve differently on each rank.
        self.out = Path(broadcast_object(cfg.trainer.output_dir)).resolve()
        self.metrics = MetricsLogger(str(self.out / METRICS_FILE), enabled=self.rank == 0)
        self.trackers = Trackers([])  # trainer.logger's trackers: started in run(), rank 0 only
        self.generations = GenerationsLog(str(self.out / GENERATIONS_FILE), enabled=self.rank == 0)
        self.scorer = build_scorer(cfg.reward, cfg.data)  # a missing reward file fails before any model
        # A preset's character tokenizer: the one the run's initial model was built with, when
        # it exists (a continued run); else a fresh one that learns the data's characters.
        saved = self.out / "init_model" / TOKENIZER_FILE
        tokenizer_dir = cfg.model.path or (str(saved.parent) if saved.is_file() else None)
        try:
            self.tokenizer = load_tokenizer(tokenizer_dir)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        encoder = PromptEncoder(self.tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_length,
                                cfg.data.overlong, cfg.model.path, grow_vocabulary=tokenizer_dir is None)
        # A file missing on one rank stops every rank; then all must have read the same records.
        self.source = on_every_rank(lambda: build_source(cfg.data, cfg.trainer.seed, encoder))
        check_same_data(self.source, cfg.data)
        if encoder.added_characters:
            _say(f"character tokenizer: added the data's characters {encoder.added_characters!r} to its "
                 f"vocabulary ({self.tokenizer.vocab_size} tokens)")
        if tokenizer_dir == str(saved.parent):
            check_tokenizer_covers(self.source, self.tokenizer,
                                   fix=f"this run's initial model ({saved.parent}) was built for the characters of "
                                       f"the data it started with: continue with that data, or start a new "
                                       f"trainer.output_dir")
        else:
            check_tokenizer_covers(self.source, self.tokenizer)
        actor = cfg.algo.actor
        if actor is not None:
            # Rank 0 checks; the others learn its verdict instead of waiting for it in a collective.
            on_every_rank(lambda: check_generation_budget(self.source, self.tokenizer, actor.max_new_tokens)
                          if self.rank == 0 else None)
        self.eval_tokens = actor.max_new_tokens if actor is not None else \
            max_answer_tokens(self.source, self.tokenizer) + 2
        check_position_budget(self.source, model_max_positions(cfg.model), self.eval_tokens,
                              "algo.actor.max_new_tokens" if actor is not None else "the longest answer")
        self.critic: FSDPEngine | None = None  # a critic estimator's value model, during the RL phase
        # One rollout engine for the whole job (a vLLM engine follows the policy across phases).
        self.sampler = build_rollout_engine(cfg.rollout, self.backend, lora=cfg.model.model_config().lora.enabled,
                                            max_positions=model_max_positions(cfg.model))
        self.t0 = time.perf_counter()
        self.stop = StopRequest()       # train.main installs it around run()
        self.position: tuple[str, int] | None = None  # (phase, steps done) of the last finished step
        self.last_checkpoint: Path | None = None
        self.pending_checkpoint: tuple[PendingCheckpoint, str] | None = None  # trainer.async_checkpoint's save in flight
        self._patches_shown: set[tuple[str, str]] = set()  # (model directory, patch summary) printed

    # ------------------------------------------------------------------ helpers
    def _shard(self, examples: list) -> list:
        """This replica's share of a step's global examples (the ranks of one SP group share it)."""
        return self.topo.replica_share(examples, "examples")

    def _engine(self, phase: str, model_dir: str, role: str = "policy") -> FSDPEngine:
        """An initialised engine for ``phase`` on ``model_dir``; ``role`` names it in the patch
        summary (``critic``: a critic estimator's value model, with its own optimizer)."""
        section = self.cfg.algo.sft if phase == "sft" else self.cfg.algo.actor
        model_config = self.cfg.model.model_config(path=model_dir)
        if role == "critic":
            section = self.cfg.algo.critic
            model_config = replace(model_config, value_head=True, value_head_init_std=section.value_head_init_std,
                                   value_head_path=section.value_head_path)
        engine = FSDPEngine(model_config, self.cfg.engine, section.optim,
                            backend=self.backend, patch_toggles=self.cfg.patches)
        try:
            engine.initialize()
        except (ValueError, TypeError, OSError) as exc:
            # A checkpoint that does not load or a model the engine cannot shard.
            raise ConfigError(f"model ({model_dir}): {type(exc).__name__}: {exc}") from None
        if role == "policy" and self.rank == 0:
            trained, total = engine.parameter_counts()
            _say(f"[{phase} {role}] trainable parameters: {trained:,} of {total:,} ({100 * trained / total:.2f}%)")
        if engine.patch_report is not None and engine.patch_report.failed:
            _say(str(engine.patch_report))  # a failed patch is worth the whole table
        elif engine.patch_report is not None and (model_dir, engine.patch_report.summary()) not in self._patches_shown:
            # The RL reference is the policy's starting model: its summary would repeat the policy's.
            self._patches_shown.add((model_dir, engine.patch_report.summary()))
            _say(f"[{phase} {role}] {engine.patch_report.summary()}")
        return engine

    def _evaluate(self, engine: FSDPEngine, tag: str, global_step: int) -> float:
        t = time.perf_counter()
        e = self.cfg.eval
        settings = EvalSettings(e.n_samples, e.temperature, e.pass_threshold,
                                seed=self.cfg.trainer.seed * 1_000_003 + global_step,
                                rows=self.cfg.trainer.log_val_generations)
        result = evaluate(engine, self.tokenizer, self.source.eval_examples, self.eval_tokens, self.scorer, settings,
                          sampler=self.sampler)
        self.metrics.log({"phase": "eval", "tag": tag, "global_step": global_step, "reward": result.reward,
                          **result.metrics, "num_prompts": len(self.source.eval_examples),
                          "time_s": time.perf_counter() - self.t0})
        if self.rank == 0 and self.cfg.trainer.plot:
            from .plot import plot_metrics

            plot_metrics(self.metrics.path, str(self.out / CURVES_FILE))  # redrawn at every evaluation
        if result.rows:
            self.generations.write(tag, global_step, GENERATION_COLUMNS, result.rows)
            self.trackers.log_table("val/generations", GENERATION_COLUMNS, result.rows, global_step)
        passed = f", pass@{e.n_samples} {result.metrics[f'pass@{e.n_samples}']:.3f}" if e.n_samples > 1 else ""
        _say(f"held-out reward ({tag}, global step {global_step}, {len(self.source.eval_examples)} prompts, "
             f"{settings.describe()}): {result.reward:.3f}{passed} "
             f"[{time.perf_counter() - t:.1f}s]")
        return result.reward

    def _checkpoint(self, engine: FSDPEngine, phase: str, step: int, global_step: int, wait: bool = False) -> Path:
        """Save the step's checkpoint; with trainer.async_checkpoint (and not ``wait``) its write
        finishes in the background (``last_checkpoint`` and the line follow when it completes)."""
        self._checkpoint_written()  # one save at a time: the previous background one first
        extra = {"phase": phase, "phase_step": step, "global_step": global_step, "world_size": self.world,
                 "metrics_lines": self.metrics.lines, "metrics_path": self.metrics.path,
                 "data_position": step * (self.cfg.trainer.sft_batch_size if phase == "sft"
                                          else self.cfg.trainer.prompts_per_step)}
        # A critic is a part of the actor's checkpoint, so no crash can leave one
        # of them at a step the other lacks, and pruning removes both together.
        saved = engine.save_checkpoint(str(self.out / "checkpoints" / phase), step=step, extra=extra,
                                       keep=self.cfg.trainer.keep_checkpoints, parts=self._parts(phase),
                                       background=self.cfg.trainer.async_checkpoint and not wait)
        where = f"(phase {phase}, step {step}, global step {global_step})"
        if isinstance(saved, PendingCheckpoint):
            self.pending_checkpoint = (saved, where)
            return saved.path
        return self._announce_checkpoint(Path(saved), where)

    def _announce_checkpoint(self, path: Path, where: str) -> Path:
        self.last_checkpoint = path  # before the line: a Ctrl-C right after it must name this one
        _say(f"{CHECKPOINT_MARKER} {path} {where}")
        return path

    def _checkpoint_written(self, block: bool = True) -> None:
        """Finish the background save in flight: wait for it (``block``) or, between steps, only
        announce it once it has completed; a failed one raises at the next blocking call, which
        every rank reaches at the same point."""
        if self.pending_checkpoint is None:
            return
        pending, where = self.pending_checkpoint
        if block or (pending.done() and not pending.failed()):
            self.pending_checkpoint = None
            self._announce_checkpoint(pending.wait(), where)

    def _stop_agreed(self, device) -> bool:
        """Whether any rank got SIGTERM: all stop at the same step boundary, none waits alone."""
        return all_reduce_max([float(self.stop.requested)], device=device)[0] > 0

    def _due(self, step: int, total: int) -> bool:
        every = self.cfg.trainer.checkpoint_interval
        return every > 0 and (step % every == 0 or step == total)

    def _record(self, phase: str, step: int, global_step: int, m: dict, progress: Progress) -> None:
        m = dict(m)
        updates = m.pop("update_metrics", None)
        # Each rank reports its replica's tokens; the ranks of one SP group hold the same ones.
        m["tokens_per_s"] = m.pop("tokens") * self.topo.dp_size / max(m["step_time_s"], 1e-9)
        record = {"phase": phase, "step": step, "global_step": global_step, **m,
                  "time_s": time.perf_counter() - self.t0}
        if step % self.cfg.trainer.log_interval == 0 or step == 1:
            # Several optimizer steps per rollout: one record each, then the rollout's summary.
            for k, u in enumerate(updates or []):
                self.metrics.log({"phase": f"{phase}_update", "step": step, "update": k + 1,
                                  "global_step": global_step, **u})
            self.metrics.log(record)
        progress.update(m)

    def _export(self, engine: FSDPEngine, directory: Path, state: dict | None = None, lora: str = "merged") -> None:
        """Export engine's model + tokenizer to ``directory`` atomically (tmp + rename); a
        LoRA model as merged weights or (``lora="adapter"``) a peft adapter directory. A
        failed write leaves no partial directory; an old ``directory`` that is a symbolic
        link is unlinked, never followed (its target stays as it was)."""
        tmp = directory.with_name(directory.name + ".tmp")
        if self.rank == 0:
            remove_path(tmp)
        try:
            engine.export_hf(str(tmp), tokenizer=self.tokenizer, **({"lora": lora} if lora != "merged" else {}))
            if self.rank == 0:
                if state is not None:
                    (tmp / STATE_FILE).write_text(json.dumps(state))
                remove_path(directory)
                os.replace(tmp, directory)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give back what was written
            raise
        barrier()

    # ------------------------------------------------------------------ phases
    def run(self) -> dict:
        """Run (or continue) the job; returns the held-out rewards by tag."""
        try:
            return self._run()
        finally:
            self.sampler.close()  # before the process group goes: a vLLM engine's groups hang off it

    def _run(self) -> dict:
        cfg, out = self.cfg, self.out
        resume = None
        if self.rank == 0:
            check_same_run(cfg, out)
            resume = find_resume(cfg, out, say=_say)
            if resume is not None and resume.run_dir != out:
                check_same_run(cfg, resume.run_dir)
            try:
                out.mkdir(parents=True, exist_ok=True)
                OmegaConf.save(OmegaConf.create(cfg.raw), out / "config.yaml")
            except OSError as exc:
                raise ConfigError(f"trainer.output_dir: cannot create {out}: {exc.strerror or exc}") from None
        resume = broadcast_object(resume)
        self.trackers = on_every_rank(lambda: self._start_trackers(resume is not None))
        self.metrics.on_record = self.trackers.log_record
        if self.trackers.trackers:
            _say(f"trackers: {self.trackers.locations()}")
        try:
            return self._run_phases(resume)
        finally:
            self.trackers.close()

    def _start_trackers(self, resuming: bool) -> Trackers:
        """trainer.logger's trackers on rank 0 (none elsewhere); one that cannot start is a ConfigError."""
        t = self.cfg.trainer
        if self.rank != 0:
            return Trackers([])
        run = RunInfo(directory=self.out, project=t.project_name, name=t.experiment_name or self.out.name,
                      tags=list(t.tags), config=self.cfg.raw)
        try:
            return start_trackers(t.logger, run, resuming)
        except TrackerStartError as exc:
            raise ConfigError(str(exc)) from None

    def _run_phases(self, resume: ResumePoint | None) -> dict:
        cfg, out = self.cfg, self.out
        start_dir = cfg.model.path or self._initial_model()
        _say(f"polyfsdp-train: {cfg.algo.name} on {cfg.data.source} data (reward {self.scorer.name}), "
             f"backend {self.backend.name}, "
             f"{self.world} rank(s){self._sp_note()}, output {out}" + (f" (resuming {resume.phase} from "
                                                      f"{resume.checkpoint or 'its start'})" if resume else ""))
        first = True
        for phase in self._phases(start_dir, resume):
            phase_resume = resume if resume is not None and resume.phase == phase.name else None
            self._run_phase(phase, phase_resume, fresh_metrics=first and resume is None)
            first = False
        return self._finish()

    def _sp_note(self) -> str:
        topo = self.topo
        return f" ({topo.dp_size} replica(s) x sequence-parallel {topo.sp_size})" if topo.sp_size > 1 else ""

    def _initial_model(self) -> str:
        try:
            return write_initial_model(str(self.out / "init_model"), self.cfg.model.preset, self.cfg.model.overrides,
                                       self.tokenizer, self.cfg.model.seed)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"model.overrides: {exc}") from None

    def _phases(self, start_dir: str, resume: ResumePoint | None) -> list[Phase]:
        """The phases still to run: SFT (unless skipped, or already done when resuming RL), then RL."""
        cfg, t = self.cfg, self.cfg.trainer
        rl = cfg.algo.rl
        sft_dir = self.out / "sft_model" if t.sft_steps > 0 else Path(start_dir)
        if resume is not None and resume.run_dir != self.out and resume.phase == RL_PHASE and t.sft_steps > 0:
            sft_dir = resume.run_dir / "sft_model"
        phases = []
        if (resume is None or resume.phase == "sft") and (t.sft_steps > 0 or not rl):
            end_dir = sft_dir if rl else (self.out / "final" if t.export else None)
            phases.append(Phase("sft", "sft", t.sft_steps, t.sft_batch_size, 0, start_dir,
                                end_tag="after_sft" if rl else "final", export_dir=end_dir, export_state=rl,
                                mid_evaluations=False))
        if rl:
            phases.append(Phase(RL_PHASE, RL_DATA_STREAM, t.rl_steps, t.prompts_per_step, t.sft_steps, str(sft_dir),
                                end_tag="final", export_dir=self.out / "final" if t.export else None,
                                export_state=False, mid_evaluations=True))
        return phases

    def _start_metrics(self, resume: ResumePoint | None, lines: int | None) -> None:
        source = None if resume is None else resume.run_dir / METRICS_FILE
        if self.rank == 0 and source is not None and source != Path(self.metrics.path) and source.is_file():
            shutil.copyfile(source, self.metrics.path)
        self.metrics.start(lines)
        if resume is not None:
            # time_s goes on from the kept records' clock instead of restarting at 0.
            self.t0 = time.perf_counter() - self.metrics.elapsed_s()
        self.trackers.continue_from(self.metrics.next_global_step())
        self.generations.start(self.metrics.next_global_step())

    def _restore(self, engine: FSDPEngine, phase: Phase, resume: ResumePoint | None, fresh_metrics: bool) -> int:
        """Position the engine and the metrics file where ``phase`` continues; returns its first step."""
        if resume is not None and resume.checkpoint is not None:
            parts = self._parts(phase.name)
            if parts:
                self._refuse_legacy_critic(resume.checkpoint)
            checkpoint, extra = load_resume_point(engine, resume, parts, say=_say)
            self.last_checkpoint = checkpoint
            saved_world = extra.get("world_size", self.world)
            if saved_world != self.world:
                _say(f"elastic resume: {checkpoint} was saved on {saved_world} rank(s), this run has {self.world}: "
                     f"model and optimizer resharded, RNG states not restored (every step seeds its own)")
            step = int(extra["phase_step"])
            if step > phase.steps:
                # Nothing to run: a "final" evaluation at the lower step count would be mislabelled.
                key = f"trainer.{phase.name}_steps"
                raise ConfigError(f"{key}={phase.steps}: {checkpoint} is already at {phase.name} step {step}; "
                                  f"set {key}>={step} to continue it, or choose another trainer.output_dir")
            self._start_metrics(resume, int(extra["metrics_lines"]))
            return step
        if resume is not None:
            # Continuing at the phase's start: the exported start model says where the records end.
            state = json.loads((Path(phase.start_dir) / STATE_FILE).read_text())
            self._start_metrics(resume, int(state["metrics_lines"]))
        elif fresh_metrics:
            self._start_metrics(None, None)
            self._evaluate(engine, "initial", 0)
        return 0

    def _parts(self, phase: str) -> dict[str, FSDPEngine]:
        """The engines saved and loaded with ``phase``'s policy as parts of its checkpoints."""
        return {CRITIC_PART: self.critic} if self.critic is not None and phase != "sft" else {}

    def _refuse_legacy_critic(self, checkpoint: Path) -> None:
        """A PPO checkpoint from before the critic was a part of it: its critic is elsewhere."""
        legacy = checkpoint.parent.parent / LEGACY_CRITIC_DIR
        try:
            held = checkpoint_parts(checkpoint)
        except CheckpointError:
            return  # loading it names what is wrong
        if legacy.is_dir() and CRITIC_PART not in held:
            raise ConfigError(f"trainer.resume: {checkpoint} holds no critic: it was written by a polyfsdp that "
                              f"kept algo=ppo's critic apart (in {legacy}), which this one does not load; finish "
                              f"that run with the polyfsdp that started it, or start a new trainer.output_dir")

    def _step_function(self, phase: Phase, engine: FSDPEngine) -> Callable[[int, list], dict]:
        """``(phase step, this rank's examples) -> metrics`` for one training step of ``phase``."""
        cfg = self.cfg
        if phase.name == "sft":
            sft_loss = SFTLoss(agg_mode=cfg.algo.sft.agg_mode)
            # rollout.env: demonstrations are conversations, tokenized as the rollout will (tool_sft.py).
            conversations = self.sampler if getattr(self.sampler, "multi_turn", False) else None

            def sft_fn(step: int, examples: list) -> dict:
                # What draws from the generators (LoRA's dropout) is seeded per step: the same in
                # every run of the seed, whatever the process's generator started from.
                self.backend.manual_seed(self._replica_seed(step))
                return sft_step(engine, self.tokenizer, examples, sft_loss, conversations=conversations)
            return sft_fn
        g = cfg.algo.actor
        # The reference is the RL starting point, frozen: a second engine, never stepped; with
        # LoRA it is the policy with its adapters off (they start at zero: the same model).
        ref = None
        if g.kl_coef > 0:
            ref = AdaptersOff(engine) if engine.model_config.lora.enabled else \
                self._engine(phase.name, phase.start_dir, role="reference")
        actor_loss = cfg.algo.actor_loss(phase.batch_size)
        mini_batches = g.mini_batches(phase.batch_size)
        value_loss, warmup = None, 0
        if cfg.algo.estimator.needs_critic:
            # The critic starts from the same model as the actor, with a fresh value head.
            self.critic = self._engine(phase.name, phase.start_dir, role="critic")
            value_loss, warmup = cfg.algo.critic.value_loss(), cfg.algo.critic.critic_warmup

        def step_fn(step: int, examples: list) -> dict:
            # Sampling (per global row) and mini-batch shuffles (same on all ranks) are seeded per
            # step: exact resume, and the same completions whatever the world size.
            step_seed = self._step_seed(step)
            more = lambda k: self._shard(self.source.batch(f"{phase.stream}-refill{k}", step, phase.batch_size))  # noqa: E731
            row_seeds = RowSeeds(cfg.trainer.seed, step, first_prompt=self.topo.share_start(phase.batch_size))
            return rl_step(engine, ref, self.tokenizer, examples, cfg.algo, actor_loss, row_seeds=row_seeds,
                           sample_seed=self._replica_seed(step), shuffle_seed=step_seed,
                           mini_batches=mini_batches, scorer=self.scorer, more_examples=more, sampler=self.sampler,
                           critic=self.critic, value_loss=value_loss, train_actor=step >= warmup)
        return step_fn

    def _warn_if_sampling_is_flat(self, engine: FSDPEngine, metrics: dict) -> None:
        """One line when the RL phase's first rollout was sampled from a near-uniform distribution
        (mean entropy >= FLAT_ENTROPY_SHARE of ln(vocabulary)): its completions score by chance, the
        group-normalised advantages are noise, and the updates walk the model away from what the
        SFT warm-up taught (measured: a LoRA warm-up of a from-scratch preset; README, Tuning)."""
        entropy, vocab = metrics.get("entropy"), getattr(engine.module.config, "vocab_size", 0)
        if entropy is None or vocab < 2 or entropy < FLAT_ENTROPY_SHARE * math.log(vocab):
            return
        if self.cfg.trainer.sft_steps > 0:
            harm = "RL may undo the SFT warm-up"
            fix = ("train the warm-up longer (trainer.sft_steps, algo.sft.optim.lr; with LoRA the adapters cannot "
                   "sharpen a from-scratch model much)")
        else:
            harm, fix = "RL learns slowly from it", "start from a trained model or add an SFT warm-up (trainer.sft_steps)"
        _say(f"warning: the first RL rollout was sampled at entropy {entropy:.2f}, near uniform over "
             f"{vocab} tokens ({math.log(vocab):.2f}): its rewards are chance and {harm}; {fix} "
             f"or lower algo.actor.temperature")

    def _step_seed(self, step: int) -> int:
        """The seed of a phase's step ``step``, from trainer.seed (the same on every rank)."""
        return self.cfg.trainer.seed * 1_000_003 + step

    def _replica_seed(self, step: int) -> int:
        """The seed of the process generators at step ``step`` on this rank's replica (what draws
        besides the rollout's sampling, which is seeded per global row: LoRA's dropout); the ranks
        of one SP group draw alike (docs/architecture.md, "Ranks, replicas and SP groups")."""
        return self._step_seed(step) * 1024 + self.topo.replica

    def _run_phase(self, phase: Phase, resume: ResumePoint | None, fresh_metrics: bool) -> None:
        """Train ``phase`` from its start (or ``resume``), with evaluations, checkpoints, export."""
        engine = self._engine(phase.name, phase.start_dir)
        step_fn = self._step_function(phase, engine)  # builds the RL reference before a checkpoint sets the RNG
        start = self._restore(engine, phase, resume, fresh_metrics)
        every = self.cfg.trainer.eval_interval if phase.mid_evaluations else 0
        progress = Progress(phase.name, phase.steps, start, self.cfg.trainer.progress,
                            enabled=self.rank == 0 and "console" in self.cfg.trainer.logger)
        for step in range(start, phase.steps):
            examples = self._shard(self.source.batch(phase.stream, step, phase.batch_size))
            global_step = phase.step_offset + step + 1
            metrics = step_fn(step, examples)
            if phase.name == RL_PHASE and step == start:
                self._warn_if_sampling_is_flat(engine, metrics)
            self._record(phase.name, step + 1, global_step, metrics, progress)
            if every and (step + 1) % every == 0 and step + 1 != phase.steps:
                self._evaluate(engine, "step", global_step)
            self.position = (phase.name, step + 1)
            self._checkpoint_written(block=False)
            saved = self._due(step + 1, phase.steps)
            if saved:
                self._checkpoint(engine, phase.name, step + 1, global_step)
            if self._stop_agreed(engine.device):
                progress.close()
                self._checkpoint_written()
                path = self.last_checkpoint if saved else \
                    self._checkpoint(engine, phase.name, step + 1, global_step, wait=True)
                raise Preempted(phase.name, step + 1, path)
        progress.close()
        self._checkpoint_written()  # the phase's last checkpoint is complete before its end
        end_step = phase.step_offset + phase.steps
        self._evaluate(engine, phase.end_tag, end_step)
        if phase.export_dir is not None:
            state = {"metrics_lines": self.metrics.lines, "global_step": end_step} if phase.export_state else None
            # A phase feeding the next one (the SFT model RL starts from) is always merged weights.
            lora = "merged" if phase.export_state else self.cfg.trainer.export_lora
            self._export(engine, phase.export_dir, state=state, lora=lora)
            if self.critic is not None:
                # Beside the actor: algo.critic.value_head_path of a later run starts its critic's head here.
                self.critic.export_value_head(phase.export_dir / CRITIC_HEAD_FILE)
        self.critic = None
        del engine, step_fn

    def _finish(self) -> dict:
        rewards = {}
        for tag in ("initial", "after_sft", "final"):
            record = self.metrics.last("eval", tag)
            if record is not None:
                rewards[tag] = record["reward"]
        if self.rank == 0:
            if self.cfg.trainer.plot:
                _say(f"curves: {self.out / CURVES_FILE}")  # drawn at the final evaluation
            _say(f"metrics: {self.metrics.path}")
            _say(f"done in {time.perf_counter() - self.t0:.1f}s")
            # The result is the last line: what a user (or `tail -1`) reads.
            chain = " -> ".join(f"{tag} {value:.3f}" for tag, value in rewards.items())
            _say(f"held-out mean reward: {chain}")
        return rewards
