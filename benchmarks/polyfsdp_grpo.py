"""polyfsdp's side of the GRPO benchmarks: the trainer's own ``rl_step`` on a checkpoint
from bench_task.py, with a per-phase timer (rollout, old log-probs, train)."""
from __future__ import annotations

import time
from contextlib import contextmanager

from bench_task import addition_reward
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.trainer.rollout import generate as gen_mod
from polyfsdp.trainer.algos import rl_step as rl_step_mod
from polyfsdp.trainer.rollout.drivers.single_turn import default_driver
from polyfsdp.trainer.config.algo import AlgoSection, ActorSection
from polyfsdp.trainer.rewards.reward_fn import Scorer
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.tokenizers import load_tokenizer


def _scoring(reward):
    """A polyfsdp reward function around ``reward(completion, answer) -> float``."""
    def score(data_source, solution_str, ground_truth, extra_info=None) -> float:
        return reward(solution_str, ground_truth)
    return score


class PhaseTimer:
    """Wall seconds per phase: wraps the driver's rollout, the engine's infer_batch and train_batch."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t
        return timed


@contextmanager
def timed_phases(engine, driver, timer: PhaseTimer):
    """Time rl_step's phases without editing trainer/algos/rl_step.py."""
    driver.rollout = timer.wrap("rollout", driver.rollout)
    engine.infer_batch = timer.wrap("old_log_probs", engine.infer_batch)
    engine.train_batch = timer.wrap("train", engine.train_batch)
    try:
        yield timer
    finally:
        del driver.rollout, engine.infer_batch, engine.train_batch


@contextmanager
def hf_generate_only(enabled: bool):
    """With ``enabled``, rollouts take the HF ``generate`` path (as before trainer/rollout/decode.py)."""
    saved = gen_mod.decode_loop_ok
    if enabled:
        gen_mod.decode_loop_ok = lambda gather_once: False
    try:
        yield
    finally:
        gen_mod.decode_loop_ok = saved


class PolyfsdpGRPO:
    """One polyfsdp policy (no reference model: kl_coef=0, as TRL's default beta=0)."""

    def __init__(self, path: str, group_size: int, max_new_tokens: int, lr: float = 1e-5,
                 engine_kwargs: dict | None = None, optim_kwargs: dict | None = None,
                 grpo_kwargs: dict | None = None, hf_generate: bool = False, reward=addition_reward,
                 driver=None) -> None:
        self.tokenizer = load_tokenizer(path)
        self.engine = FSDPEngine(ModelConfig(path=path), EngineConfig(**(engine_kwargs or {})),
                                 OptimConfig(lr=lr, grad_clip=1.0, **(optim_kwargs or {}))).initialize()
        self.cfg = AlgoSection(actor=ActorSection(group_size=group_size, max_new_tokens=max_new_tokens,
                                                temperature=1.0, kl_coef=0.0, entropy_coef=0.0, clip_ratio_low=0.2,
                                                clip_ratio_high=0.28, **(grpo_kwargs or {})))
        self.loss = None  # built per step: the loss normalises over the step's prompt count
        self.scorer = Scorer(_scoring(reward), "addition")
        self.hf_generate = hf_generate  # sample with HF generate instead of trainer/rollout/decode.py
        self.driver = driver or default_driver()  # e.g. a SingleTurnDriver over the vLLM engine

    def step(self, prompts: list[dict], seed: int, row_seeds=None) -> dict:
        """One GRPO step on ``prompts`` (dicts with prompt/answer, optionally prompt_ids: the chat
        template's tokens); returns its metrics. ``row_seeds``: a RowSeeds, as the trainer passes."""
        examples = [Example(prompt=p["prompt"], answer=p["answer"],
                            prompt_ids=tuple(p["prompt_ids"]) if "prompt_ids" in p else None) for p in prompts]
        loss = self.cfg.actor_loss(len(prompts))
        with hf_generate_only(self.hf_generate):
            ctx = rl_step_mod.RLContext(self.engine, self.tokenizer, self.cfg, loss, scorer=self.scorer,
                                        mini_batches=self.cfg.actor.mini_batches(len(prompts)), driver=self.driver)
            return rl_step_mod.rl_step(ctx, examples, rl_step_mod.StepSeeds(seed, rows=row_seeds))

    def run(self, batches: list[list[dict]], seed: int, warmup: int) -> tuple[list[float], list[float], dict]:
        """Step through ``batches``; per timed step its wall seconds and tokens, and the
        phase totals over the timed steps."""
        times, tokens = [], []
        timer = PhaseTimer()
        for i, prompts in enumerate(batches):
            if i == warmup:
                timer.times.clear()
            with timed_phases(self.engine, self.driver, timer):
                t = time.perf_counter()
                m = self.step(prompts, seed * 100_003 + i)
                dt = time.perf_counter() - t
            if i >= warmup:
                times.append(dt)
                tokens.append(m["tokens"])
        return times, tokens, dict(timer.times)
