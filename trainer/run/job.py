"""The training job: SFT warm-up, then RL, with evaluation, checkpoints and resume.

Output directory layout::

    run.lock             held while a run writes here: a second run is refused (trainer/output_dir_lock.py)
    config.yaml          the resolved configuration
    started_in.json      rank 0's working directory, rewritten at every start: polyfsdp-eval reads
                         config.yaml's relative data paths from it (trainer/config/run_start.py)
    metrics.jsonl        one record per step / evaluation (rank 0)
    generations.jsonl    trainer.log_val_generations / log_rollout_samples: completions per evaluation / RL step
    rollout_servers/     rollout.engine=vllm_server: the logs of the servers the run started
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
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from polyfsdp.backends.distributed import all_gather_object, broadcast_object, current_rank, init_distributed
from polyfsdp.backends.topology import topology
from polyfsdp.backends.registry import get_backend
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.model.lora import AdaptersOff
from polyfsdp.engines.losses import SFTLoss

from ..data.chat import model_max_positions
from ..config.sections import JobConfig
from ..config.run_start import save_run_config
from ..errors import ConfigError
from ..evaluation.held_out import GENERATION_COLUMNS, EvalSettings, evaluate
from ..rollout.flat_sampling import flat_sampling_warning
from ..evaluation.generations_log import GENERATIONS_FILE, GenerationsLog
from ..output_dir_lock import hold_output_dir
from .checkpoints import JobCheckpoints
from .job_data import job_processor, load_job_data
from ..tracking.metrics import METRICS_FILE, MetricsLogger
from ..tracking.plot import CURVES_FILE
from .export import export_model
from .model_init import write_initial_model
from .phases import Phase, engine_settings, plan_phases
from .progress import Progress
from ..rank_errors import on_every_rank
from ..rewards.sources import build_reward
from ..algos.rl_step import RLContext, empty_step_warning
from ..algos.rl_steps import RLSteps
from ..algos.sample_ahead import SampleAhead, resume_sampled_ahead
from ..rollout.build import build_rollout_driver, build_rollout_engine
from .resume import RL_PHASE, STATE_FILE, ResumePoint, check_no_linked_run_files, check_same_run, find_resume
from .state import PhaseState
from ..rollout.row_seeds import replica_seed, step_seed
from ..algos.sft import sft_step
from .stop import SigtermStops, StopRequest
from ..tracking import Trackers, start_run_trackers

logger = logging.getLogger(__name__)


def _say(message: str) -> None:
    """A progress line on rank 0's stdout (flushed: tests and log tailers read it live);
    above a live progress bar when one is showing."""
    if current_rank() == 0:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


class Job(SigtermStops):
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
        self.tokenizer, self.source, self.eval_tokens = load_job_data(cfg, self.out, self.rank, say=_say)
        self.scorer = build_reward(cfg.reward, cfg.data, (cfg, self.tokenizer, self.backend))  # before the policy
        self.critic: FSDPEngine | None = None  # a critic estimator's value model, during the RL phase
        self.sample_ahead: SampleAhead | None = None  # rollout.max_staleness > 0: the RL phase's pipeline
        # One rollout engine for the job (vLLM's follows the policy across phases; servers log to the run), its driver.
        rollout_engine = build_rollout_engine(cfg.rollout, self.backend, lora=cfg.model.model_config().lora.enabled,
                                              log_dir=str(self.out / "rollout_servers"),
                                              processor_factory=lambda: job_processor(cfg, self.tokenizer))
        self.driver = build_rollout_driver(cfg.rollout, rollout_engine, max_positions=model_max_positions(cfg.model))
        self.t0 = time.perf_counter()
        self.stop = StopRequest()       # train.main installs it around run()
        self.position: tuple[str, int] | None = None  # (phase, steps done) of the last finished step
        self.checkpoints = JobCheckpoints(self.out, cfg.trainer, self.world, say=_say)
        self._patches_shown: set[tuple[str, str]] = set()  # (model directory, patch summary) printed

    # ------------------------------------------------------------------ helpers
    def _shard(self, examples: list) -> list:
        """This replica's share of a step's global examples (the ranks of one SP group share it)."""
        return self.topo.replica_share(examples, "examples")

    def _engine(self, phase: str, model_dir: str, role: str = "policy", label: str | None = None) -> FSDPEngine:
        """An initialised engine for ``phase`` on ``model_dir``; ``role`` names it in the patch
        summary (``critic``: a critic estimator's value model, with its own optimizer; ``teacher``:
        algo.distill's); ``label`` replaces ``"<phase> <role>"`` in the lines it prints
        (polyfsdp-eval: what it evaluates)."""
        label = label or f"{phase} {role}"
        optim, model_config = engine_settings(self.cfg, phase, model_dir, role)
        engine = FSDPEngine(model_config, self.cfg.engine, optim, backend=self.backend, patch_toggles=self.cfg.patches)
        try:
            engine.initialize()
        except (ValueError, TypeError, OSError) as exc:
            # A checkpoint that does not load or a model the engine cannot shard.
            key = "algo.distill.teacher" if role == "teacher" else "model"
            raise ConfigError(f"{key} ({model_dir}): {type(exc).__name__}: {' '.join(str(exc).split())}") from None
        if role == "policy" and self.rank == 0:
            trained, total = engine.parameter_counts()
            _say(f"[{label}] trainable parameters: {trained:,} of {total:,} ({100 * trained / total:.2f}%)")
        if engine.patch_report is not None and engine.patch_report.failed:
            _say(str(engine.patch_report))  # a failed patch is worth the whole table
        elif engine.patch_report is not None and (model_dir, engine.patch_report.summary()) not in self._patches_shown:
            # The RL reference is the policy's starting model: its summary would repeat the policy's.
            self._patches_shown.add((model_dir, engine.patch_report.summary()))
            _say(f"[{label}] {engine.patch_report.summary()}")
        return engine

    def _evaluate(self, engine: FSDPEngine, tag: str, global_step: int, where: str | None = None) -> float:
        """The held-out evaluation, logged under ``tag``; ``where`` (default ``tag``) opens its line."""
        t = time.perf_counter()
        e = self.cfg.eval
        settings = EvalSettings.of(e, seed=step_seed(self.cfg.trainer.seed, global_step),
                                   rows=self.cfg.trainer.log_val_generations)
        result = evaluate(engine, self.tokenizer, self.source.eval_examples, self.eval_tokens, self.scorer, settings,
                          driver=self.driver)
        self.metrics.log({"phase": "eval", "tag": tag, "global_step": global_step, "reward": result.reward,
                          **result.metrics, "num_prompts": len(self.source.eval_examples),
                          "time_s": time.perf_counter() - self.t0})
        if self.rank == 0 and self.cfg.trainer.plot:
            from ..tracking.plot import plot_metrics

            plot_metrics(self.metrics.path, str(self.out / CURVES_FILE))  # redrawn at every evaluation
        if result.rows:
            self.generations.write(tag, global_step, GENERATION_COLUMNS, result.rows)
            self.trackers.log_table("val/generations", GENERATION_COLUMNS, result.rows, global_step)
        passed = f", pass@{e.n_samples} {result.metrics[f'pass@{e.n_samples}']:.3f}" if e.n_samples > 1 else ""
        _say(f"held-out reward ({where or tag}, global step {global_step}, {len(self.source.eval_examples)} prompts, "
             f"{settings.describe()}): {result.reward:.3f}{passed} [{time.perf_counter() - t:.1f}s]")
        return result.reward

    def _checkpoint(self, engine: FSDPEngine, phase: str, step: int, global_step: int, wait: bool = False,
                    eval_due: bool = False) -> Path:
        """Save the step's checkpoint: every part of the phase's state (``state.py``), with the
        batches sampled ahead (every rank's, gathered: rank 0 writes the position)."""
        ahead = None if self.sample_ahead is None else all_gather_object(self.sample_ahead.state())
        staleness = self.cfg.rollout.max_staleness if phase == RL_PHASE else None
        return self.checkpoints.save_step(self._state(phase, engine), phase, step, global_step, self.metrics,
                                          wait=wait, eval_due=eval_due, sampled_ahead=ahead, max_staleness=staleness)

    def _state(self, phase: str, engine: FSDPEngine) -> PhaseState:
        """The parts of ``phase``'s checkpoints: its policy, and the critic in the RL phase."""
        return PhaseState(engine, critic=self.critic if phase != "sft" else None)

    def _record(self, phase: str, step: int, global_step: int, m: dict, progress: Progress) -> None:
        m = dict(m)
        updates, samples = m.pop("update_metrics", None), m.pop("rollout_samples", None)
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
            if samples:  # trainer.log_rollout_samples: rank 0's prompts, as the validation generations
                self.generations.write("rollout", global_step, GENERATION_COLUMNS, samples)
                self.trackers.log_table("train/generations", GENERATION_COLUMNS, samples, global_step)
        progress.update(m)

    # ------------------------------------------------------------------ phases
    def run(self) -> dict:
        """Run (or continue) the job; returns the held-out rewards by tag."""
        try:
            with hold_output_dir(self.out, say=_say):  # before anything is written, until any exit
                return self._run()
        finally:
            self.driver.engine.close()  # before the process group goes: a vLLM engine's groups hang off it
            for held in (self.driver, self.scorer):  # rollout.agent's endpoint, reward.judge's server
                getattr(held, "close", lambda: None)()

    def _run(self) -> dict:
        cfg, out = self.cfg, self.out
        resume = None
        if self.rank == 0:
            check_no_linked_run_files(out)
            check_same_run(cfg, out)
            resume = find_resume(cfg, out, say=_say)
            if resume is not None and resume.run_dir != out:
                check_same_run(cfg, resume.run_dir)
            try:
                save_run_config(out, cfg.raw)  # and where the run started (started_in.json)
            except OSError as exc:
                raise ConfigError(f"trainer.output_dir: cannot create {out}: {exc.strerror or exc}") from None
        resume = broadcast_object(resume)
        # trainer.logger's trackers on rank 0 (none elsewhere); one that cannot start is a ConfigError.
        self.trackers = on_every_rank(lambda: start_run_trackers(self.cfg.trainer, out, cfg.raw, resume is not None)
                                      if self.rank == 0 else Trackers([]))
        self.metrics.on_record = self.trackers.log_record
        if self.trackers.trackers:
            _say(f"trackers: {self.trackers.locations()}")
        try:
            return self._run_phases(resume)
        finally:
            self.trackers.close()

    def _run_phases(self, resume: ResumePoint | None) -> dict:
        cfg, out = self.cfg, self.out
        start_dir = cfg.model.path or self._initial_model()
        _say(f"polyfsdp-train: {cfg.algo.name} on {cfg.data.source} data "
             f"(reward {cfg.rollout.describe_reward(self.scorer.name)}), backend {self.backend.name}, "
             f"{self.world} rank(s){self._sp_note()}, output {out}" + (f" (resuming {resume.phase} from "
                                                      f"{resume.checkpoint or 'its start'})" if resume else ""))
        first = True
        for phase in plan_phases(self.cfg, self.out, start_dir, resume):
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

    def _start_metrics(self, resume: ResumePoint | None, lines: int | None, redo: tuple | None = None) -> None:
        source = None if resume is None else resume.run_dir / METRICS_FILE
        if self.rank == 0 and source is not None and source != Path(self.metrics.path) and source.is_file():
            shutil.copyfile(source, self.metrics.path)
        self.metrics.start(lines)
        if resume is not None:
            # time_s goes on from the kept records' clock instead of restarting at 0.
            self.t0 = time.perf_counter() - self.metrics.elapsed_s()
        self.trackers.continue_from(self.metrics.next_global_step())
        # ``redo``: an evaluation the checkpoint says is due, whose rows a stopped run may have written.
        self.generations.start(self.metrics.next_global_step(), drop=redo)

    def _restore(self, engine: FSDPEngine, phase: Phase, resume: ResumePoint | None,
                 fresh_metrics: bool) -> tuple[int, bool]:
        """Position the engine and the metrics file where ``phase`` continues; returns its first
        step and whether the evaluation due before it is still to run."""
        if resume is not None and resume.checkpoint is not None:
            position = self.checkpoints.restore(self._state(phase.name, engine), resume, phase.steps)
            resume_sampled_ahead(self.sample_ahead, position, self.rank, self.world, _say)
            redo = ("step", position.global_step) if position.eval_due else None
            self._start_metrics(resume, position.metrics_lines, redo=redo)
            return position.phase_step, position.eval_due
        if resume is not None:
            # Continuing at the phase's start: the exported start model says where the records end.
            state = json.loads((Path(phase.start_dir) / STATE_FILE).read_text())
            self._start_metrics(resume, int(state["metrics_lines"]))
        elif fresh_metrics:
            self._start_metrics(None, None)
            if self.cfg.eval.initial:  # off: the starting model's score is known (a pretrained model's)
                self._evaluate(engine, "initial", 0)
        return 0, False

    def _step_function(self, phase: Phase, engine: FSDPEngine) -> Callable[[int, list], dict]:
        """``(phase step, this rank's examples) -> metrics`` for one training step of ``phase``."""
        cfg = self.cfg
        if phase.name == "sft":
            sft_loss = SFTLoss(agg_mode=cfg.algo.sft.agg_mode)
            # rollout.env: demonstrations are conversations, tokenized as the rollout will (tool_sft.py).
            conversations = self.driver if cfg.rollout.env is not None else None

            def sft_fn(step: int, examples: list) -> dict:
                # What draws from the generators (LoRA's dropout) is seeded per step: the same in
                # every run of the seed, whatever the process's generator started from.
                self.backend.manual_seed(replica_seed(self.cfg.trainer.seed, step, self.topo.replica))
                return sft_step(engine, self.tokenizer, examples, sft_loss, conversations=conversations,
                                chat_template=cfg.data.apply_chat_template)
            return sft_fn
        g = cfg.algo.actor
        # The reference is the RL starting point, frozen: a second engine, never stepped; with
        # LoRA it is the policy with its adapters off (they start at zero: the same model).
        ref = None
        if g.kl_coef > 0:
            ref = AdaptersOff(engine) if engine.model_config.lora.enabled else \
                self._engine(phase.name, phase.start_dir, role="reference")
        # algo.distill's teacher: frozen and sharded like the reference, never LoRA (trainer/algos/distill/).
        teacher = self._engine(phase.name, cfg.algo.distill.teacher, "teacher") if cfg.algo.distill.enabled else None
        actor_loss = cfg.algo.actor_loss(phase.batch_size)
        mini_batches = g.mini_batches(phase.batch_size)
        value_loss, warmup = None, 0
        if cfg.algo.estimator.needs_critic:
            # The critic starts from the same model as the actor, with a fresh value head.
            self.critic = self._engine(phase.name, phase.start_dir, role="critic")
            value_loss, warmup = cfg.algo.critic.value_loss(), cfg.algo.critic.critic_warmup

        # Sampling (per global row) and mini-batch shuffles (same on all ranks) are seeded per step:
        # exact resume, and the same completions whatever the world size.
        shard_of = lambda stream, step: self._shard(self.source.batch(stream, step, phase.batch_size))  # noqa: E731
        ctx = RLContext(engine, self.tokenizer, cfg.algo, actor_loss, ref=ref, mini_batches=mini_batches,
                        scorer=self.scorer, driver=self.driver, critic=self.critic, value_loss=value_loss,
                        teacher=teacher, samples=cfg.trainer.log_rollout_samples)
        steps = RLSteps(ctx, cfg.trainer.seed, self.topo.replica, examples=lambda step: shard_of(phase.stream, step),
                        refill=lambda step, k: shard_of(f"{phase.stream}-refill{k}", step),
                        first_prompt=self.topo.share_start(phase.batch_size), warmup=warmup)
        if cfg.rollout.max_staleness == 0:
            return steps.run
        self.sample_ahead = SampleAhead(steps, cfg.rollout.max_staleness, phase.steps)
        return self.sample_ahead.step

    def _run_phase(self, phase: Phase, resume: ResumePoint | None, fresh_metrics: bool) -> None:
        """Train ``phase`` from its start (or ``resume``), with evaluations, checkpoints, export.
        A boundary's checkpoint comes before its evaluation (run at the next step's start, recorded
        as due): a SIGTERM stops there, or abandons what has not updated weights yet (stop.py)."""
        engine = self._engine(phase.name, phase.start_dir)
        step_fn = self._step_function(phase, engine)  # builds the RL reference before a checkpoint sets the RNG
        start, eval_due = self._restore(engine, phase, resume, fresh_metrics)
        every = self.cfg.trainer.eval_interval if phase.mid_evaluations else 0
        progress = Progress(phase.name, phase.steps, start, self.cfg.trainer.progress,
                            enabled=self.rank == 0 and "console" in self.cfg.trainer.logger)
        for step in range(start, phase.steps):
            examples = self._shard(self.source.batch(phase.stream, step, phase.batch_size))
            global_step = phase.step_offset + step + 1

            def evaluate_then_step():
                nonlocal eval_due
                if eval_due:
                    self._evaluate(engine, "step", global_step - 1, where=f"{phase.name} step {step}")
                    eval_due = False
                return step_fn(step, examples)
            metrics = self._abandonable(evaluate_then_step, engine, phase, step, lambda: eval_due, progress,
                                        f"{phase.name} step {step + 1}")
            # One line if the run's first RL rollout was sampled near uniform (flat_sampling.py): a
            # resumed run past it says nothing again.
            if phase.name == RL_PHASE and step == 0:
                vocab = getattr(engine.module.config, "vocab_size", 0)
                if (warning := flat_sampling_warning(metrics.get("entropy"), vocab, self.cfg.trainer.sft_steps)):
                    _say(warning)
            if phase.name == RL_PHASE and (warning := empty_step_warning(metrics, step + 1)):
                _say(warning)
            self._record(phase.name, step + 1, global_step, metrics, progress)
            self.position = (phase.name, step + 1)
            eval_due = bool(every) and (step + 1) % every == 0 and step + 1 != phase.steps
            self.checkpoints.written(block=False)
            if self.checkpoints.due(step + 1, phase.steps):
                self._checkpoint(engine, phase.name, step + 1, global_step, eval_due=eval_due)
            if self._stop_agreed():
                self._preempt(engine, phase, step + 1, eval_due, progress)
        progress.close()
        self.checkpoints.written()  # the phase's last checkpoint is complete before its end
        end_step = phase.step_offset + phase.steps
        # A resumed run evaluates the phase's end by itself: nothing is due in the checkpoint.
        self._abandonable(lambda: self._evaluate(engine, phase.end_tag, end_step), engine, phase, phase.steps,
                          lambda: False, progress, f"the {phase.end_tag} evaluation")
        if phase.export_dir is not None:
            state = {"metrics_lines": self.metrics.lines, "global_step": end_step} if phase.export_state else None
            # A phase feeding the next one (the SFT model RL starts from) is always merged weights.
            lora = "merged" if phase.export_state else self.cfg.trainer.export_lora
            export_model(engine, phase.export_dir, self.tokenizer, state=state, lora=lora, critic=self.critic)
        self.critic, self.sample_ahead = None, None

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
