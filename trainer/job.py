"""The training job: SFT warm-up, then GRPO, with evaluation, checkpoints and resume.

Output directory layout::

    config.yaml          the resolved configuration
    metrics.jsonl        one record per step / evaluation (rank 0)
    init_model/          the preset's starting weights + tokenizer (presets only)
    checkpoints/sft/     engine checkpoints of the SFT phase (step_*/, latest)
    checkpoints/grpo/    engine checkpoints of the GRPO phase
    sft_model/           the SFT-end weights: GRPO's starting point and its KL reference
    final/               Hugging Face export of the trained model + tokenizer
    curves.png           reward and loss curves

Every batch and every sampling seed is a function of the step, and each checkpoint stores
how many metrics records precede it, so ``trainer.resume=auto`` continues the same curve.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from polyfsdp.backends.distributed import current_rank, current_world_size, init_distributed
from polyfsdp.backends.registry import get_backend
from polyfsdp.engines.checkpoint import latest_checkpoint
from polyfsdp.engines.engine import FSDPEngine
from polyfsdp.engines.losses import SFTLoss

from .chat import PromptEncoder, check_position_budget, model_max_positions
from .config import ConfigError, JobConfig
from .data import build_source, check_generation_budget, check_tokenizer_covers, max_answer_tokens
from .generate import evaluate
from .grpo import grpo_step
from .metrics import METRICS_FILE, MetricsLogger
from .model_init import write_initial_model
from .progress import Progress
from .rewards import build_scorer
from .sft import sft_step
from .task import load_tokenizer

logger = logging.getLogger(__name__)

STATE_FILE = "polyfsdp_state.json"
CHECKPOINT_MARKER = "checkpoint saved:"


@dataclass
class ResumePoint:
    """Where a run continues: ``phase`` from ``checkpoint`` (None: the phase's start) of ``run_dir``."""

    phase: str
    checkpoint: Path | None
    run_dir: Path


def _say(message: str) -> None:
    """A progress line on rank 0's stdout (flushed: tests and log tailers read it live);
    above a live progress bar when one is showing."""
    if current_rank() == 0:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


def _sft_complete(run_dir: Path) -> bool:
    return (run_dir / "sft_model" / STATE_FILE).is_file()


def find_resume(cfg: JobConfig, out: Path) -> ResumePoint | None:
    """The point ``trainer.resume`` asks to continue from, or None for a fresh run."""
    mode = cfg.trainer.resume
    if mode == "never":
        for name in ("checkpoints", "sft_model", METRICS_FILE):
            if (out / name).exists():
                raise ConfigError(f"trainer.resume=never but {out} already holds a run ({name}); "
                                  f"choose another trainer.output_dir or use trainer.resume=auto")
        return None
    if mode == "auto":
        run_dir = out
        ckpt_root = out / "checkpoints"
        if cfg.algo.name == "sft" and (_sft_complete(out) or latest_checkpoint(ckpt_root / "grpo") is not None):
            # Resuming its SFT checkpoints would cut the GRPO records and overwrite final/.
            raise ConfigError(f"trainer.resume=auto: {out} holds an algo=grpo run, but algo=sft was asked for; "
                              f"choose another trainer.output_dir or resume with algo=grpo")
    else:
        path = Path(mode).resolve()
        # PATH is .../checkpoints/<phase>[/step_N] of a polyfsdp-train run.
        phase_dir = path if path.name in ("sft", "grpo") else path.parent
        if phase_dir.name not in ("sft", "grpo") or phase_dir.parent.name != "checkpoints":
            raise ConfigError(f"trainer.resume: {mode!r} is not a polyfsdp-train checkpoint "
                              f"(expected OUTPUT_DIR/checkpoints/sft|grpo[/step_N])")
        run_dir = phase_dir.parent.parent
        if phase_dir.name == "grpo" and cfg.algo.name == "sft":
            raise ConfigError(f"trainer.resume: {mode!r} is a GRPO checkpoint, but algo=sft runs no GRPO phase; "
                              f"resume with algo=grpo or from OUTPUT_DIR/checkpoints/sft")
        found = path if path.name.startswith("step_") else latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"trainer.resume: no complete checkpoint in {mode!r}")
        return ResumePoint(phase_dir.name, found, run_dir)
    grpo_ckpt = latest_checkpoint(ckpt_root / "grpo")
    if cfg.algo.name == "grpo" and grpo_ckpt is not None:
        return ResumePoint("grpo", grpo_ckpt, run_dir)
    if cfg.algo.name == "grpo" and cfg.trainer.sft_steps > 0 and _sft_complete(run_dir):
        return ResumePoint("grpo", None, run_dir)
    sft_ckpt = latest_checkpoint(ckpt_root / "sft")
    if sft_ckpt is not None:
        return ResumePoint("sft", sft_ckpt, run_dir)
    return None


# Settings a continued run must share with the run it continues: they decide the model, the
# data each step draws (a function of seed, phase, step and batch size) and the updates. The
# rest (step counts, intervals, logging, engine modes, patches, backend) may change on resume.
SAME_RUN_SECTIONS = ("model", "data", "reward", "algo.sft", "algo.grpo")
SAME_RUN_TRAINER_KEYS = ("seed", "sft_batch_size", "prompts_per_step")


def _section(raw: dict, dotted: str) -> dict | None:
    for part in dotted.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def check_same_run(cfg: JobConfig, run_dir: Path) -> None:
    """A run continued in (or from) ``run_dir`` must ask for the model, data and algorithm
    it was started with: its init_model and checkpoints would be loaded and the data stream
    continued, while config.yaml claimed the new settings."""
    saved = run_dir / "config.yaml"
    started = any((run_dir / name).exists() for name in ("init_model", "checkpoints", "sft_model"))
    if not (started and saved.is_file()):
        return
    before_raw = OmegaConf.to_container(OmegaConf.load(saved))
    pairs = []
    for dotted in SAME_RUN_SECTIONS:
        before, now = _section(before_raw, dotted), _section(cfg.raw, dotted)
        if dotted == "algo.grpo" and (before is None or now is None):
            continue  # an SFT run continued into GRPO: no GRPO settings to keep yet
        pairs.append((dotted, before or {}, now or {}))
    trainer_before = before_raw.get("trainer") or {}
    pairs.append(("trainer", {k: trainer_before.get(k) for k in SAME_RUN_TRAINER_KEYS},
                  {k: cfg.raw["trainer"].get(k) for k in SAME_RUN_TRAINER_KEYS}))
    for dotted, before, now in pairs:
        for key in list(now) + [k for k in before if k not in now]:
            if before.get(key) != now.get(key):
                name = f"{dotted}.{key}"
                raise ConfigError(f"trainer.resume={cfg.trainer.resume}: {run_dir} holds a run of {name}="
                                  f"{before.get(key)!r}, but this run asks for {name}={now.get(key)!r}; keep "
                                  f"the model, data and algo settings (and trainer.seed, sft_batch_size, "
                                  f"prompts_per_step) or choose another trainer.output_dir")


def _load(engine: FSDPEngine, checkpoint: Path) -> tuple[int, dict]:
    """Load a resume checkpoint; one that is incomplete or unreadable is a ConfigError."""
    try:
        return engine.load_checkpoint(str(checkpoint))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"trainer.resume: cannot load {checkpoint}: {type(exc).__name__}: {exc}") from None


def _broadcast(value):
    if current_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


class Job:
    """One run of ``polyfsdp-train`` (every rank builds one)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        if cfg.trainer.cpu_threads is not None:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        self.backend = get_backend(cfg.backend)
        init_distributed(self.backend)
        self.rank, self.world = current_rank(), current_world_size()
        # Rank 0's output_dir wins: "${now:...}" may resolve differently on each rank.
        self.out = Path(_broadcast(cfg.trainer.output_dir)).resolve()
        self.metrics = MetricsLogger(str(self.out / METRICS_FILE), enabled=self.rank == 0)
        self.scorer = build_scorer(cfg.reward, cfg.data)  # a missing reward file fails before any model
        try:
            self.tokenizer = load_tokenizer(cfg.model.path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        encoder = PromptEncoder(self.tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_length,
                                cfg.data.overlong, cfg.model.path)
        self.source = build_source(cfg.data, cfg.trainer.seed, encoder)
        check_tokenizer_covers(self.source, self.tokenizer)
        grpo = cfg.algo.grpo
        if grpo is not None and self.rank == 0:
            check_generation_budget(self.source, self.tokenizer, grpo.max_new_tokens)
        self.eval_tokens = grpo.max_new_tokens if grpo is not None else \
            max_answer_tokens(self.source, self.tokenizer) + 2
        check_position_budget(self.source, model_max_positions(cfg.model), self.eval_tokens,
                              "algo.grpo.max_new_tokens" if grpo is not None else "the longest answer")
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------ helpers
    def _shard(self, examples: list) -> list:
        per = len(examples) // self.world
        return examples[self.rank * per:(self.rank + 1) * per]

    def _engine(self, phase: str, model_dir: str) -> FSDPEngine:
        model_config = self.cfg.model.model_config(path=model_dir)
        engine = FSDPEngine(model_config, self.cfg.phase_engine_config(phase), backend=self.backend,
                            patch_toggles=self.cfg.patches)
        try:
            engine.initialize()
        except (ValueError, TypeError, OSError) as exc:
            # A checkpoint that does not load or a model the engine cannot shard.
            raise ConfigError(f"model ({model_dir}): {type(exc).__name__}: {exc}") from None
        if engine.patch_report is not None and engine.patch_report.failed:
            _say(str(engine.patch_report))  # a failed patch is worth the whole table
        elif engine.patch_report is not None:
            _say(f"[{phase}] {engine.patch_report.summary()}")
        return engine

    def _evaluate(self, engine: FSDPEngine, tag: str, global_step: int) -> float:
        t = time.perf_counter()
        value = evaluate(engine, self.tokenizer, self.source.eval_examples, self.eval_tokens, scorer=self.scorer)
        self.metrics.log({"phase": "eval", "tag": tag, "global_step": global_step, "reward": value,
                          "num_prompts": len(self.source.eval_examples), "time_s": time.perf_counter() - self.t0})
        _say(f"held-out reward ({tag}, global step {global_step}, {len(self.source.eval_examples)} prompts, "
             f"greedy): {value:.3f} "
             f"[{time.perf_counter() - t:.1f}s]")
        return value

    def _checkpoint(self, engine: FSDPEngine, phase: str, step: int, global_step: int) -> None:
        extra = {"phase": phase, "phase_step": step, "global_step": global_step,
                 "metrics_lines": self.metrics.lines, "metrics_path": self.metrics.path,
                 "data_position": step * (self.cfg.trainer.sft_batch_size if phase == "sft"
                                          else self.cfg.trainer.prompts_per_step)}
        path = engine.save_checkpoint(str(self.out / "checkpoints" / phase), step=step, extra=extra,
                                      keep=self.cfg.trainer.keep_checkpoints)
        _say(f"{CHECKPOINT_MARKER} {path} (phase {phase}, step {step}, global step {global_step})")

    def _due(self, step: int, total: int) -> bool:
        every = self.cfg.trainer.checkpoint_interval
        return every > 0 and (step % every == 0 or step == total)

    def _record(self, phase: str, step: int, global_step: int, m: dict, progress: Progress) -> None:
        m = dict(m)
        m["tokens_per_s"] = m.pop("tokens") * self.world / max(m["step_time_s"], 1e-9)
        record = {"phase": phase, "step": step, "global_step": global_step, **m,
                  "time_s": time.perf_counter() - self.t0}
        if step % self.cfg.trainer.log_interval == 0 or step == 1:
            self.metrics.log(record)
        progress.update(m)

    def _export(self, engine: FSDPEngine, directory: Path, state: dict | None = None) -> None:
        """Export engine's model + tokenizer to ``directory`` atomically (tmp + rename)."""
        tmp = directory.with_name(directory.name + ".tmp")
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        engine.export_hf(str(tmp), tokenizer=self.tokenizer)
        if self.rank == 0:
            if state is not None:
                (tmp / STATE_FILE).write_text(json.dumps(state))
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(tmp, directory)
        if dist.is_initialized():
            dist.barrier()

    # ------------------------------------------------------------------ phases
    def run(self) -> dict:
        """Run (or continue) the job; returns the held-out rewards by tag."""
        cfg, out = self.cfg, self.out
        resume = None
        if self.rank == 0:
            check_same_run(cfg, out)
            resume = find_resume(cfg, out)
            if resume is not None and resume.run_dir != out:
                check_same_run(cfg, resume.run_dir)
            try:
                out.mkdir(parents=True, exist_ok=True)
                OmegaConf.save(OmegaConf.create(cfg.raw), out / "config.yaml")
            except OSError as exc:
                raise ConfigError(f"trainer.output_dir: cannot create {out}: {exc.strerror or exc}") from None
        resume = _broadcast(resume)
        if cfg.model.path:
            start_dir = cfg.model.path
        else:
            try:
                start_dir = write_initial_model(str(out / "init_model"), cfg.model.preset, cfg.model.overrides,
                                                self.tokenizer, cfg.model.seed)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"model.overrides: {exc}") from None
        _say(f"polyfsdp-train: {cfg.algo.name} on {cfg.data.source} data (reward {self.scorer.name}), "
             f"backend {self.backend.name}, "
             f"{self.world} rank(s), output {out}" + (f" (resuming {resume.phase} from "
                                                      f"{resume.checkpoint or 'its start'})" if resume else ""))
        sft_steps = cfg.trainer.sft_steps
        sft_dir = out / "sft_model" if sft_steps > 0 else Path(start_dir)
        if resume is not None and resume.run_dir != out and resume.phase == "grpo":
            sft_dir = resume.run_dir / "sft_model" if sft_steps > 0 else sft_dir
        if resume is None or resume.phase == "sft":
            if sft_steps > 0 or cfg.algo.name == "sft":
                self._run_sft(start_dir, resume, sft_dir)
        if cfg.algo.name == "grpo":
            self._run_grpo(sft_dir, resume if resume is not None and resume.phase == "grpo" else None,
                           fresh_metrics=sft_steps == 0 and resume is None)
        return self._finish()

    def _start_metrics(self, resume: ResumePoint | None, lines: int | None) -> None:
        source = None if resume is None else resume.run_dir / METRICS_FILE
        if self.rank == 0 and source is not None and source != Path(self.metrics.path) and source.is_file():
            shutil.copyfile(source, self.metrics.path)
        self.metrics.start(lines)

    def _run_sft(self, start_dir: str, resume: ResumePoint | None, sft_dir: Path) -> None:
        cfg = self.cfg
        total = cfg.trainer.sft_steps
        engine = self._engine("sft", start_dir)
        start = 0
        if resume is not None:
            _, extra = _load(engine, resume.checkpoint)
            start = int(extra["phase_step"])
            self._start_metrics(resume, int(extra["metrics_lines"]))
        else:
            self._start_metrics(None, None)
            self._evaluate(engine, "initial", 0)
        loss_fn = SFTLoss(agg_mode=cfg.algo.sft.agg_mode)
        progress = Progress("sft", total, start, cfg.trainer.progress, enabled=self.rank == 0)
        for step in range(start, total):
            examples = self._shard(self.source.batch("sft", step, cfg.trainer.sft_batch_size))
            m = sft_step(engine, self.tokenizer, examples, loss_fn)
            self._record("sft", step + 1, step + 1, m, progress)
            if self._due(step + 1, total):
                self._checkpoint(engine, "sft", step + 1, step + 1)
        progress.close()
        if cfg.algo.name == "grpo":
            self._evaluate(engine, "after_sft", total)
            self._export(engine, sft_dir, state={"metrics_lines": self.metrics.lines, "global_step": total})
        else:
            self._evaluate(engine, "final", total)
            if cfg.trainer.export:
                self._export(engine, self.out / "final")
        del engine

    def _run_grpo(self, sft_dir: Path, resume: ResumePoint | None, fresh_metrics: bool) -> None:
        cfg = self.cfg
        g = cfg.algo.grpo
        total, offset = cfg.trainer.grpo_steps, cfg.trainer.sft_steps
        policy = self._engine("grpo", str(sft_dir))
        # The reference is the GRPO starting point, frozen: a second engine, never stepped.
        ref = self._engine("grpo", str(sft_dir)) if g.kl_coef > 0 else None
        start = 0
        if resume is not None and resume.checkpoint is not None:
            _, extra = _load(policy, resume.checkpoint)
            start = int(extra["phase_step"])
            self._start_metrics(resume, int(extra["metrics_lines"]))
        elif resume is not None:
            state = json.loads((sft_dir / STATE_FILE).read_text())
            self._start_metrics(resume, int(state["metrics_lines"]))
        elif fresh_metrics:
            self._start_metrics(None, None)
            self._evaluate(policy, "initial", 0)
        loss_fn = g.loss()
        progress = Progress("grpo", total, start, cfg.trainer.progress, enabled=self.rank == 0)
        for step in range(start, total):
            examples = self._shard(self.source.batch("grpo", step, cfg.trainer.prompts_per_step))
            seed = (cfg.trainer.seed * 1_000_003 + step) * 1024 + self.rank
            m = grpo_step(policy, ref, self.tokenizer, examples, g, loss_fn, sample_seed=seed, scorer=self.scorer)
            self._record("grpo", step + 1, offset + step + 1, m, progress)
            every = cfg.trainer.eval_interval
            if every and (step + 1) % every == 0 and step + 1 != total:
                self._evaluate(policy, "step", offset + step + 1)
            if self._due(step + 1, total):
                self._checkpoint(policy, "grpo", step + 1, offset + step + 1)
        progress.close()
        self._evaluate(policy, "final", offset + total)
        if cfg.trainer.export:
            self._export(policy, self.out / "final")
        del policy, ref

    def _finish(self) -> dict:
        rewards = {}
        for tag in ("initial", "after_sft", "final"):
            record = self.metrics.last("eval", tag)
            if record is not None:
                rewards[tag] = record["reward"]
        if self.rank == 0:
            chain = " -> ".join(f"{tag} {value:.3f}" for tag, value in rewards.items())
            _say(f"held-out mean reward: {chain}")
            if self.cfg.trainer.plot:
                from .plot import plot_metrics

                png = plot_metrics(self.metrics.path, str(self.out / "curves.png"))
                _say(f"curves: {png}")
            _say(f"metrics: {self.metrics.path}")
            _say(f"done in {time.perf_counter() - self.t0:.1f}s")
        return rewards
