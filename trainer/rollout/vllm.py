"""vLLM as the rollout engine (``rollout.engine=vllm``), colocated with the trainer: one
engine per rank (tensor parallel 1) holding a copy of the policy's weights.

- Start: at the first rollout, from the policy's own config and weights (streamed from the
  FSDP2 shards, engines/model/weight_stream.py) written to a local temporary directory; never a hub.
- Sync (``update_weights``, called before a rollout): when the policy's ``weights_version`` moved (an applied optimizer
  step, a checkpoint load) or the engine is a different one (the next phase), every rank
  streams the full weights in buckets of ``rollout.sync_bucket_mb`` into vLLM (one reload for
  all of them: trainer/rollout/vllm_adapter.py), which resets its prefix cache; a layer of
  vLLM's model left without weights stops the run, named; ``weight_version`` counts the syncs.
  ``rollout.check_sync`` then compares vLLM's log-probs of a fixed probe sequence with the
  policy's and stops beyond ``rollout.check_sync_tol`` (a missed or partial sync is the usual
  failure of this design).
  ``generate`` never syncs: it samples with the weights of the last sync.
- Sampling: the same stop tokens (kept in the completion), temperature, top-p, top-k and
  repetition penalty as our loop (vLLM's own, defined alike: trainer/rollout/controls/logits_shaping.py),
  stop strings cut after sampling (trainer/rollout/controls/stop_strings.py: vLLM runs without a
  tokenizer); each request has its own seed: its row seed (trainer/rollout/row_seeds.py:
  trainer.seed, step, global row) in RL rollouts, so the same prompts draw the same completions
  whatever the world size, else one drawn from the process's seeded generator.
- Sleep (GPU/NPU, backends' ``rollout_sleep_level``): after a rollout (the caller's ``sleep``) vLLM
  frees its device memory for training; the weights are woken before a sync (a level-2 sleep
  dropped them: they come back by one) and the KV cache after it.

Every vLLM call is in trainer/rollout/vllm_adapter.py.
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
import weakref

import torch

from polyfsdp.engines.model.weight_stream import full_weights, weight_buckets

from . import vllm_adapter
from ..data.batch import build_batch, per_sequence
from ..errors import ConfigError
from ..rank_errors import on_every_rank
from .engines import Completions, RolloutEngine, SamplingParams
from .controls.stop_strings import cut_completions
from .servers.settings import VllmSettings
from .servers.vision_serving import (MAX_IMAGES_PER_PROMPT, VisionServing, is_vision_language, prompt_pictures,
                                     vision_serving)

logger = logging.getLogger(__name__)

PROBE_LENGTH = 32
HOST_KV_CACHE_MB = 512  # rollout.vllm.kv_cache_mb=null where device memory is host memory (CPU)


def kv_cache_mb(configured: int | None, backend) -> int | None:
    """The KV cache a vLLM engine or server gets: ``rollout.vllm.kv_cache_mb``, else HOST_KV_CACHE_MB
    where device memory is host memory (CPU); None: vLLM sizes it from its memory share."""
    return configured or (HOST_KV_CACHE_MB if backend.memory_is_host else None)


def probe_length(max_model_len: int) -> int:
    """The sync probe's length on a model of ``max_model_len`` positions: PROBE_LENGTH, or less
    where vLLM would refuse it (every request asks for at least one token after its prompt);
    ConfigError where not even 2 tokens (one log-prob) fit."""
    length = min(PROBE_LENGTH, max_model_len - 1)
    if length < 2:
        raise ConfigError(f"rollout.engine=vllm: the model holds {max_model_len} positions (max_position_embeddings, "
                          f"or rollout.vllm.max_model_len); vLLM's sync probe needs at least 3")
    return length


def probe_ids(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed token sequence spread over the vocabulary (the sync check's input)."""
    return [(7 * i + 3) % vocab_size for i in range(length)]


def policy_probe_log_probs(policy, ids: list[int], image=None) -> list[float]:
    """The policy's ``log p(ids[t] | ids[:t])`` for t >= 1 at temperature 1 (collective); ``image``:
    the pixel inputs of the probe's image (:class:`ImageProbe`)."""
    batch = build_batch([(ids[:1], ids[1:])], policy.engine_config.pad_mode, pad_token_id=0,
                        images=None if image is None else [image])
    out = policy.infer_batch(batch, temperature=1.0, calculate_entropy=False)["log_probs"]
    return per_sequence(out, batch, policy.engine_config.pad_mode)[0][:-1].tolist()


def probe_difference(sampled: list[float], policy, ids: list[int], image=None) -> float:
    """The largest difference between a sampler's log-probs of the probe ``ids`` and the policy's (collective)."""
    return max(abs(a - b) for a, b in zip(sampled, policy_probe_log_probs(policy, ids, image)))


def served_positions(config, max_model_len: int | None) -> int:
    """The positions vLLM serves for a model of HF ``config``: ``max_model_len``, else the model's own."""
    return max_model_len or getattr(config.get_text_config(), "max_position_embeddings", None) or PROBE_LENGTH + 1


def sync_probe(config, positions: int) -> list[int]:
    """The sync check's text probe for a model of HF ``config`` served with ``positions``."""
    return probe_ids(config.get_text_config().vocab_size, probe_length(positions))


def sync_error(policy, probe: list[int], vision, sampler_log_probs) -> float:
    """The largest difference between a sampler's and the policy's log-probs of the text ``probe``
    and, for a vision-language model (``vision``: its VisionServing, else None), of the image probe
    (collective). ``sampler_log_probs(ids, picture)`` asks the sampler; ``picture`` is None for text."""
    error = probe_difference(sampler_log_probs(probe, None), policy, probe)
    if vision is not None:
        image = vision.probe
        error = max(error, probe_difference(sampler_log_probs(image.ids, image.picture), policy, image.ids, image))
    return error


def refuse_probe_difference(diff: float, tol: float, version: int, sampler: str,
                            error: type[ConfigError] = ConfigError, likely_cause: str | None = None) -> None:
    """``error`` naming ``sampler`` (one line) when ``diff`` passes ``tol``: the check ``rollout.check_sync``
    makes after every sync, colocated or on servers. ``likely_cause``: what the caller knows explains
    the difference better than a missed sync (with its fix), e.g. the sampler's dtype differing from
    the policy's."""
    if not diff <= tol:
        cause = likely_cause or (f"{sampler} is not serving the trained weights (a missed or partial sync); raise "
                                 f"the tolerance only if the two run at different precisions")
        raise error(f"rollout.check_sync: after weight sync {version}, {sampler}'s log-probs of the probe differ from "
                    f"the policy's by {diff:.3g} (rollout.check_sync_tol={tol:g}): {cause}")


def sleep_level(settings: VllmSettings, backend, lora: bool) -> int:
    """How deep the engine sleeps between rollouts: ``rollout.vllm.sleep_level``, ``auto`` the backend's (0: never)."""
    level = backend.rollout_sleep_level(lora) if settings.sleep_level == "auto" else settings.sleep_level
    return level or 0


def colocated_memory(settings: VllmSettings, weights: int, backend, lora: bool) -> tuple[int, int, str]:
    """What the engine holds per rank, for ``--estimate`` (nothing of vLLM is imported):
    ``(awake, asleep, how)``: the bytes while it samples, while the trainer steps (a level-1
    sleep moves the weights to the host, level 2 drops them; both free the KV cache), and how
    they were counted. ``weights``: its copy of the policy in the rollout dtype."""
    kv_mb = kv_cache_mb(settings.kv_cache_mb, backend)
    capacity = None if kv_mb or backend.availability() is not None else backend.memory_capacity_bytes()
    if kv_mb:
        awake, how = weights + (kv_mb << 20), f"weights + {kv_mb} MiB KV cache"
    elif capacity:
        awake = int(settings.gpu_memory_utilization * capacity)
        how = f"{settings.gpu_memory_utilization:g} x {capacity / 2 ** 30:.1f} GiB"
    else:  # a device this machine does not have: its size is unknown, so the KV cache is
        awake, how = weights, "weights; KV cache unknown"
    return awake, (awake if sleep_level(settings, backend, lora) == 0 else 0), how


class VllmRolloutEngine(RolloutEngine):
    """``rollout.engine=vllm`` (module docstring); ``rollout`` is the RolloutSection."""

    name = "vllm"
    holds_weights = True
    takes_images = True  # Qwen2-VL and Qwen2.5-VL policies (servers/vllm_vision.py)

    def __init__(self, rollout, backend, lora: bool = False) -> None:
        self.rollout, self.backend = rollout, backend
        self.settings = rollout.vllm
        self.sleep_level = sleep_level(self.settings, backend, lora)
        if self.sleep_level:
            conflict = backend.vllm_sleep_mode_conflict(True, os.environ)
            if conflict is not None:
                raise ConfigError(f"rollout.engine=vllm: {conflict}")
        self.llm = None
        self.model_dir: str | None = None
        self.probe: list[int] = []        # the sync check's tokens, sized to the model at start
        self.weight_version = 0           # syncs done (the start counts as the first)
        self.last_sync_s: float | None = None
        self.last_sync_error: float | None = None
        self._policy = None               # weakref to the engine last synced
        self._policy_version = None
        self._asleep = False
        self.vision: VisionServing | None = None  # a vision-language policy's, once started
        # What the weight stream yields (a seam for tests that drop a parameter on purpose).
        self.buckets = weight_buckets

    # ------------------------------------------------------------------ weights
    def _start(self, policy) -> None:
        """Write the policy's config and weights to a local directory; start vLLM on it."""
        from safetensors.torch import save_file

        config = copy.deepcopy(policy.module.config)
        positions = served_positions(config, self.settings.max_model_len)
        self.probe = sync_probe(config, positions)
        directory = tempfile.mkdtemp(prefix="polyfsdp-vllm-")
        config.use_cache = True
        # vLLM's copy keeps the output embedding as a weight of its own: reloading a tied
        # input embedding leaves vLLM's LM head (its own processed copy on CPU) stale.
        config.tie_word_embeddings = False
        if is_vision_language(config):
            self.vision = vision_serving(policy, self.processor_factory, self.probe, "rollout.engine=vllm")
            self.vision.write(directory, config)
        config.save_pretrained(directory)
        # Every rank joins each gather (collective) and writes its own local copy.
        state = {name: tensor.to("cpu", copy=True).contiguous()
                 for name, tensor in full_weights(policy.module, untie=True)}
        save_file(state, f"{directory}/model.safetensors", metadata={"format": "pt"})
        del state
        kv_mb = kv_cache_mb(self.settings.kv_cache_mb, self.backend)
        vision = self.vision is not None
        options = vllm_adapter.StartOptions(
            model_dir=directory, dtype=policy.engine_config.param_dtype, seed=0,
            gpu_memory_utilization=None if self.backend.memory_is_host else self.settings.gpu_memory_utilization,
            kv_cache_bytes=kv_mb << 20 if kv_mb else None, max_model_len=self.settings.max_model_len,
            max_num_seqs=self.settings.max_num_seqs, enable_sleep_mode=self.sleep_level > 0,
            tokenizer=vision, max_images=MAX_IMAGES_PER_PROMPT if vision else 0,
            chunked_prefill=self.backend.vllm_chunked_prefill, positions=positions)
        t0 = time.perf_counter()
        self.llm = vllm_adapter.start(options, install=self._install_hint())
        self.model_dir = directory
        try:  # the first forward is where vLLM finds it has no kernel for a model (e.g. its head size)
            vllm_adapter.prompt_log_probs(self.llm, self.probe)
        except Exception as exc:
            raise vllm_adapter.start_error(exc) from None
        logger.info("vLLM rollout engine started in %.1fs", time.perf_counter() - t0)

    def _install_hint(self) -> str:
        return "polyfsdp[vllm]" if self.backend.vllm_package == "vllm" else self.backend.vllm_package

    def _push(self, policy) -> None:
        """Stream the policy's weights into the running engine (collective)."""
        bucket_bytes = int(self.rollout.sync_bucket_mb * (1 << 20))
        if self._asleep:
            vllm_adapter.wake_up(self.llm, ["weights"])
        missing = vllm_adapter.load_weights(self.llm, self.buckets(policy.module, bucket_bytes, untie=True))
        vllm_adapter.drop_stale_caches(self.llm)
        if missing:
            raise ConfigError(f"rollout.engine=vllm: weight sync {self.weight_version + 1}: "
                              f"{vllm_adapter.unloaded_message(missing)}")

    def _wake_cache(self) -> None:
        if self._asleep:
            vllm_adapter.wake_up(self.llm, ["kv_cache"])
            self._asleep = False

    def update_weights(self, policy) -> None:
        """Bring vLLM's weights to the policy's if they changed, starting vLLM at the first call,
        and wake its KV cache for sampling (collective; every rank calls it)."""
        current = self._policy() if self._policy is not None else None
        # Level-2 sleep drops the weights: they come back only by a sync.
        stale = current is not policy or self._policy_version != policy.weights_version or \
            (self._asleep and self.sleep_level == 2)
        if self.llm is not None and not stale:
            if self._asleep and self.sleep_level == 1:  # the weights wait on the host; they are current
                vllm_adapter.wake_up(self.llm, ["weights"])
            self._wake_cache()
            return
        t0 = time.perf_counter()
        with policy.eval_mode():
            if self.llm is None:
                self._start(policy)
            else:
                self._push(policy)
        self._wake_cache()
        self.last_sync_s = time.perf_counter() - t0
        self.weight_version += 1
        self._policy, self._policy_version = weakref.ref(policy), policy.weights_version
        if self.rollout.check_sync:
            self.check(policy)

    def check(self, policy) -> float:
        """vLLM's vs the policy's log-probs of the probe: the largest difference; ConfigError
        (one line) beyond ``rollout.check_sync_tol``."""
        def sampled(ids, picture):
            if picture is None:
                return vllm_adapter.prompt_log_probs(self.llm, ids)
            return vllm_adapter.prompt_log_probs(self.llm, ids, [picture], self.vision.image_token_id)

        self.last_sync_error = sync_error(policy, self.probe, self.vision, sampled)
        refuse_probe_difference(self.last_sync_error, self.rollout.check_sync_tol, self.weight_version, "vLLM")
        return self.last_sync_error

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None,
                 images: list | None = None) -> Completions:
        """``images``: one Example (its ``images``, as encoded into the prompt) or None per prompt."""
        if self.llm is None:
            raise RuntimeError("rollout.engine=vllm: generate before update_weights (vLLM holds no weights yet)")
        # One seed per request, never depending on vLLM's scheduling: the row's own, else one from
        # the process's seeded generator (vLLM's start, in the sync before, leaves it as it was).
        seeds = list(seeds) if seeds is not None else torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        self.wake()
        # A refusal on one rank's rows must stop every rank (what follows a rollout is collective).
        pictures = on_every_rank(lambda: prompt_pictures(images, self.vision, "rollout.engine=vllm"))
        vision = self.vision
        # Its refusals too (a completion aborted on every try, another image expansion) stop every rank.
        completions, log_probs = on_every_rank(lambda: vllm_adapter.sample(
            self.llm, prompts, params, seeds, pictures, vision and vision.image_token_id,
            vision and vision.logit_bias))
        return Completions(*cut_completions(completions, log_probs, params))

    def sleep(self) -> None:
        """Free vLLM's device memory (``sleep_level``; none on CPU) until the next rollout."""
        if self.sleep_level > 0 and self.llm is not None and not self._asleep:
            vllm_adapter.sleep(self.llm, self.sleep_level)
            self._asleep = True

    def wake(self) -> None:
        """Take back the KV cache; weights a level-2 sleep dropped come back only by :meth:`update_weights`."""
        if self._asleep and self.sleep_level == 2:
            raise RuntimeError("rollout.engine=vllm: asleep at level 2 (its weights dropped): update_weights first")
        self._wake_cache()

    def close(self) -> None:
        if self.llm is not None:
            vllm_adapter.shutdown(self.llm)
            self.llm = None
        if self.model_dir is not None:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            self.model_dir = None
