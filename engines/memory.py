"""Per-rank memory estimates, before the run, without building the model on a device: one
training micro-batch (``python -m polyfsdp.engines.memory --preset qwen2-small --tokens 4096``)
and, through :class:`ModelMemory`, the pieces ``polyfsdp-train ... --estimate`` sums per phase
(trainer/run/estimate.py): state, training micro-batches, no-grad passes and generation.

Parameter, gradient and optimizer figures are exact counts: the model is built on the meta
device (no storage), LoRA adapters are added there too, and every tensor is sized the way
FSDP2 shards it (dim 0 padded to a multiple of the world size). Activations are an estimate
from the tensors autograd saves per token in a Llama/Qwen-style decoder (listed in
:func:`saved_per_token`), at the micro-batch token budget, with and without activation
checkpointing; the logits path adds the ``(tokens, vocab)`` tensors that the fused head
never materialises. A no-grad pass keeps no activations: one layer's working set
(:func:`layer_working_set_per_token`) and the head; generation adds its KV cache. A sharded
model adds FSDP2's unsharded copies (the root and two layers gathered, a layer's and the root's
gradients before their reduce-scatter), and AdamW's step its temporaries.

Where device memory is host memory (the CPU) a process also holds its interpreter and
libraries (:data:`HOST_PROCESS_BYTES`), and glibc's malloc keeps part of the freed activations
in its heaps, so the resident set of a step exceeds its live tensors (:func:`host_heap_slack`).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import torch

from .config import TORCH_DTYPES, EngineConfig, LoraConfig, ModelConfig
from .head.fused import default_chunk_size
from .memory_vision import tower_memory

MIB = 2 ** 20
# AdamW keeps exp_avg and exp_avg_sq per parameter, plus a float32 ``step`` per tensor.
ADAM_MOMENTS = 2
ADAM_STEP_BYTES = 4
# Vocabulary-sized float32 tensors at the peak of the unfused log-prob path's backward:
# the logits, log_softmax's saved output and the gradient flowing back through them;
# the entropy adds exp(log_probs), saved for its backward.
LOGITS_PATH_TENSORS = 3
# The fused head's float32 (chunk, V) working buffers (engines/head/fused.py).
FUSED_HEAD_BUFFERS = 2
# Vocabulary-sized float32 tensors of a no-grad log-prob pass: the logits and log_softmax's output.
INFERENCE_LOGITS_TENSORS = 2
# Host memory only. One trainer process before its job: python, torch, transformers and
# polyfsdp imported, a first forward/backward run (362 MiB measured: Linux, torch 2.13 CPU).
HOST_PROCESS_BYTES = 360 * MIB
# Host memory only: what a training micro-batch adds to the resident set beyond its live
# tensors, as a share of its activations. glibc's malloc serves tensors under its (adaptive, up
# to 32 MiB) mmap threshold from heaps it keeps, and the backward, freeing activations while it
# allocates gradients, leaves holes that later tensors do not fit. Measured on SmolLM2-135M
# (forward + backward of 3328-3352 tokens): 13-18% of the activations for a full fine-tune (1 and 2
# ranks), 44-62% where more temporaries come and go between the long-lived tensors: LoRA
# (peft's adapter branches) and activation checkpointing (each layer's recompute). No-grad passes
# and generation showed none. ``MALLOC_MMAP_THRESHOLD_=65536`` brings the resident set to the live
# tensors at about a third more system time in the step.
HOST_HEAP_SLACK = 0.15
HOST_HEAP_SLACK_CHURN = 0.5


def hf_config_of(model_config: ModelConfig):
    """The Hugging Face config a ModelConfig builds (read from disk for a path; never downloads)."""
    if model_config.path is not None:
        from .model.builder import read_hf_config

        return read_hf_config(model_config.path)
    from .presets import preset_config

    overrides = {} if model_config.vocab_size is None else {"vocab_size": model_config.vocab_size}
    return preset_config(model_config.preset, **overrides)


def meta_model(model_config: ModelConfig, hf_config=None):
    """The model (with its LoRA adapters) on the meta device: shapes and dtypes, no storage.
    ``hf_config`` replaces the one ``model_config`` names (e.g. a preset resized by the trainer).
    A vision-language model is built by its own class, its tower frozen as ``freeze_vision`` says."""
    from .model.builder import auto_class_for

    hf_config = hf_config or hf_config_of(model_config)
    with torch.device("meta"):
        model = auto_class_for(hf_config).from_config(hf_config, dtype=TORCH_DTYPES[model_config.dtype])
        if model_config.freeze_vision:
            from .model.vision import freeze_vision

            freeze_vision(model)
        if model_config.lora.enabled:
            from .model.lora import add_adapters

            add_adapters(model, model_config.lora)
    return model


def shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements one rank holds of a parameter FSDP2 shards on dim 0 (padded to the world size)."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def lora_targets_per_layer(model) -> list[int]:
    """LoRA rank of each adapted linear in the first decoder layer (empty without LoRA)."""
    from .parallel.fsdp import decoder_layers

    ranks = []
    for module in decoder_layers(model)[0].modules():
        adapters = getattr(module, "lora_A", None)
        if isinstance(adapters, torch.nn.ModuleDict) and adapters:
            ranks.extend(a.out_features for a in adapters.values())
    return ranks


def _attention_dims(hf_config) -> tuple[int, int]:
    """``(query width, key/value width)`` of one attention layer."""
    hf_config = hf_config.get_text_config()  # a vision-language model's text decoder
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return heads * head_dim, kv_heads * head_dim


def saved_per_token(hf_config, lora_ranks: list[int] = ()) -> dict[str, int]:
    """Elements autograd keeps per token for backward, by place (no activation checkpointing):

    - each RMSNorm: its input, the normalised value and the weighted output (3h) + 1/rms;
    - attention: rotated q and k, v, the attention output and its reshaped copy for o_proj;
    - the gated MLP: gate, act(gate), up and their product (4 x intermediate);
    - a LoRA linear: its ``lora_A`` output (rank).
    """
    hf_config = hf_config.get_text_config()
    h = hf_config.hidden_size
    q_dim, kv_dim = _attention_dims(hf_config)
    norm = 3 * h + 1
    layer = 2 * norm + (q_dim + 2 * kv_dim + 2 * q_dim) + 4 * hf_config.intermediate_size + sum(lora_ranks)
    return {"layer": layer, "layer_input": h, "final_norm": norm, "embedding": h}


def layer_working_set_per_token(hf_config) -> int:
    """Elements live at once, per token, inside one decoder layer's forward without autograd
    (log-prob passes, generation's prefill): the residual stream and the normed input (2h)
    beside the larger of attention's q, k, v, output and rotated q, k (3q + 3kv) and the gated
    MLP's activated gate, up and their product (3 x intermediate)."""
    hf_config = hf_config.get_text_config()
    h = hf_config.hidden_size
    q_dim, kv_dim = _attention_dims(hf_config)
    return 2 * h + max(3 * q_dim + 3 * kv_dim, 3 * hf_config.intermediate_size)


def host_heap_slack(activations: int, churn: bool) -> int:
    """The resident bytes glibc's heaps add to a training micro-batch of ``activations`` live
    bytes (host memory); ``churn``: LoRA adapters or activation checkpointing."""
    return int(activations * (HOST_HEAP_SLACK_CHURN if churn else HOST_HEAP_SLACK))


def kv_cache_bytes(hf_config, rows: int, positions: int, compute_bytes: int) -> int:
    """Generation's KV cache: keys and values of every layer, ``rows x positions`` (the
    decoding loop preallocates prompt width + max_new_tokens positions, trainer/rollout/decode.py)."""
    _, kv_dim = _attention_dims(hf_config)
    return 2 * hf_config.get_text_config().num_hidden_layers * rows * positions * kv_dim * compute_bytes


def saved_activation_bytes(hf_config, tokens: int, compute_bytes: int, checkpointing: bool) -> int:
    """What autograd keeps for the backward of a training micro-batch of ``tokens`` tokens, without
    adapters or the head (a floor: :meth:`ModelMemory.activation_rows` adds them): every layer's
    saved activations, or with activation checkpointing each layer's input and one layer recomputed."""
    saved, layers = saved_per_token(hf_config), hf_config.get_text_config().num_hidden_layers
    around = saved["embedding"] + saved["final_norm"]
    per_token = layers * saved["layer_input"] + saved["layer"] if checkpointing else layers * saved["layer"]
    return compute_bytes * tokens * (per_token + around)


class ModelMemory:
    """Per-rank memory figures of one engine's model under ``engine_config`` on ``world_size``
    ranks: exact state bytes from the meta-device model (``value_head``: a critic, its LM head
    replaced by ``hidden -> 1``), and the transient bytes of a training micro-batch, a no-grad
    forward (log-prob and value passes) and a generation, each for a token count."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, world_size: int = 1,
                 hf_config=None, value_head: bool = False) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
        model = meta_model(model_config, hf_config)
        if value_head:
            from .head.value import install_value_head

            with torch.device("meta"):
                install_value_head(model, init_std=0.01, seed=0)
        self.engine_config, self.world_size, self.value_head = engine_config, world_size, value_head
        # Per-token terms follow the text decoder (text_config); a vision tower's go by patches (memory_vision.py).
        self.hf_config = model.config.get_text_config()
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        shard_bytes = lambda ps: sum(shard_numel(p.shape, world_size) * p.element_size() for p in ps)  # noqa: E731
        self.num_params, self.num_trainable = sum(p.numel() for p in params), sum(p.numel() for p in trainable)
        self.compute_bytes = TORCH_DTYPES[engine_config.param_dtype].itemsize
        self.tower = tower_memory(model, self.compute_bytes, model_config.freeze_vision)
        self.params = shard_bytes(params)
        self.grads = shard_bytes(trainable)
        self.optimizer = ADAM_MOMENTS * self.grads + ADAM_STEP_BYTES * len(trainable)
        # rollout.unshard on several ranks: the whole model gathered in the compute dtype.
        self.gathered = 0 if world_size == 1 else self.num_params * self.compute_bytes
        self.saved = saved_per_token(self.hf_config, lora_targets_per_layer(model))
        self.vocab = 1 if value_head else self.hf_config.vocab_size
        self.largest_trained = max((shard_bytes([p]) for p in trainable), default=0)
        # What a separate sampler (vLLM) loads: the base weights, adapters merged, a tied output
        # embedding as a weight of its own (trainer/rollout/vllm.py: untie=True).
        tied = getattr(self.hf_config, "tie_word_embeddings", False) and not value_head
        self.sampler_params = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) + \
            (self.vocab * self.hf_config.hidden_size if tied else 0)
        self.fsdp_forward, self.fsdp_backward = self._fsdp_buffers(model, engine_config, world_size)

    def _fsdp_buffers(self, model, engine_config: EngineConfig, world_size: int) -> tuple[int, int]:
        """FSDP2's unsharded copies on a sharded model (engines/parallel/fsdp.py: needs_sharding):
        in every forward the root (kept gathered until the backward is done) and two layers (the
        running one and the prefetched one; every layer with ``reshard_policy=never``) in
        param_dtype; in a backward a layer's and the root's full gradients in reduce_dtype
        before their reduce-scatter. ``(0, 0)`` for the plain one-rank model."""
        from .parallel.fsdp import decoder_layers

        wanted = {TORCH_DTYPES[engine_config.param_dtype], TORCH_DTYPES[engine_config.reduce_dtype]}
        if world_size == 1 and not engine_config.shard_single_rank and \
                all({p.dtype} == wanted for p in model.parameters() if p.is_floating_point()):
            return 0, 0
        layers = decoder_layers(model)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_layers]
        gathered = len(layers) if engine_config.reshard_policy == "never" else min(2, len(layers))
        per_layer = sum(p.numel() for p in layers[0].parameters())
        forward = (sum(p.numel() for p in root) + gathered * per_layer) * self.compute_bytes
        trained = [p for p in [*root, *layers[0].parameters()] if p.requires_grad]
        return forward, sum(p.numel() for p in trained) * TORCH_DTYPES[engine_config.reduce_dtype].itemsize

    def optimizer_step(self, impl: str, host_backend: bool) -> int:
        """AdamW's temporaries in its step (``impl`` as OptimConfig.impl; ``auto`` is torch's
        choice: foreach on accelerators, the for-loop on the CPU): the for-loop's ``sqrt`` and
        its quotient of the largest trained shard, foreach's ``sqrt`` of every trained shard,
        none in the fused kernel or the host step of ``offload=optimizer``."""
        if impl == "fused" or ("optimizer" in self.host_state(host_backend)):
            return 0
        if impl == "for_loop" or (impl == "auto" and host_backend):
            return 2 * self.largest_trained
        return self.grads

    def _head(self, tokens: int, tensors: int) -> int:
        """The head's bytes at its peak: ``tensors`` float32 ``(tokens, vocab)`` tensors on the
        logits path, the fused head's chunk buffers, nothing a critic's scalar head counts."""
        if self.value_head:
            return 0
        if self.engine_config.use_fused_kernels:
            return FUSED_HEAD_BUFFERS * default_chunk_size(tokens, self.vocab) * self.vocab * 4
        return tokens * self.vocab * 4 * tensors

    def activation_rows(self, tokens: int, entropy: bool, checkpointing: bool | None = None,
                        patches: int = 0) -> dict[str, int]:
        """A training micro-batch of ``tokens`` tokens and ``patches`` image patches: saved activations
        with and without checkpointing, the head's paths, the tower's, the step as configured (last row)."""
        layers, saved = self.hf_config.num_hidden_layers, self.saved
        per_token = self.compute_bytes * tokens
        around_layers = saved["embedding"] + saved["final_norm"]
        unfused = 0 if self.value_head else tokens * self.vocab * 4 * (LOGITS_PATH_TENSORS + int(entropy))
        fused = 0 if self.value_head else FUSED_HEAD_BUFFERS * default_chunk_size(tokens, self.vocab) * self.vocab * 4
        rows = {
            f"activations saved, {tokens} tokens": per_token * (layers * saved["layer"] + around_layers),
            # Checkpointing keeps each layer's input and recomputes one layer at a time in backward.
            f"activations saved, {tokens} tokens, checkpointed": per_token * (layers * saved["layer_input"]
                                                                             + around_layers),
            "one layer recomputed (checkpointed)": per_token * saved["layer"],
            "logits path (unfused)": unfused,
            "fused head buffers": fused,
            "logits the fused head avoids": max(0, unfused - fused),
        }
        head = fused if self.engine_config.use_fused_kernels else unfused
        # The head's backward runs while every saved activation is alive; a checkpointed layer's
        # recompute comes after the head's buffers are freed, so the larger of the two counts.
        checkpointing = self.engine_config.gradient_checkpointing if checkpointing is None else checkpointing
        if checkpointing:
            step = rows[f"activations saved, {tokens} tokens, checkpointed"] + \
                max(head, rows["one layer recomputed (checkpointed)"])
        else:
            step = rows[f"activations saved, {tokens} tokens"] + head
        if patches:  # the tower runs before the decoder's activations exist (its backward after they
            # are freed); what it saves stays alive through the whole step
            rows[f"vision tower saved, {patches} patches"] = tower = self.tower.saved(patches, checkpointing)
            rows["vision tower working set (a block)"] = transient = self.tower.transient(patches, checkpointing)
            step = max(step, transient) + tower
        rows["step activations + head (as configured)"] = step
        return rows

    def train_step(self, tokens: int, entropy: bool, checkpointing: bool | None = None, patches: int = 0) -> int:
        """Activations and head of a training micro-batch of ``tokens`` tokens and ``patches`` image
        patches (as configured, or with ``checkpointing`` on or off), and FSDP2's unsharded copies."""
        rows = self.activation_rows(tokens, entropy, checkpointing, patches)
        return rows["step activations + head (as configured)"] + self.fsdp_forward + self.fsdp_backward

    def inference(self, tokens: int, entropy: bool = False, patches: int = 0) -> int:
        """A no-grad forward over ``tokens`` tokens (``infer_batch``, ``infer_values``): one layer's
        working set and the hidden states (or, before them, a tower block's over ``patches``), then the
        head (logits and log-softmax float32, plus exp(log-probs) for the entropy) or the fused head's buffers."""
        body = max(self.compute_bytes * tokens * (layer_working_set_per_token(self.hf_config)
                                                  + self.hf_config.hidden_size), self.tower.transient(patches))
        return body + self._head(tokens, INFERENCE_LOGITS_TENSORS + int(entropy)) + self.fsdp_forward

    def generation(self, rows: int, prompt_width: int, new_tokens: int, patches: int = 0) -> int:
        """Sampling ``new_tokens`` for ``rows`` prompts of ``prompt_width`` (``patches`` image patches): the KV
        cache at its full size plus the largest of the prefill's layer working set (only the last position's
        logits are kept), the tower's and a decoding step's float32 (rows, vocab) logits, probs and log-probs."""
        cache = kv_cache_bytes(self.hf_config, rows, prompt_width + new_tokens, self.compute_bytes)
        prefill = self.compute_bytes * rows * prompt_width * layer_working_set_per_token(self.hf_config)
        step = rows * self.vocab * 4 * INFERENCE_LOGITS_TENSORS + rows * self.vocab * self.compute_bytes
        return cache + max(prefill, step, self.tower.transient(patches))

    def host_state(self, host_backend: bool) -> set[str]:
        """Which of ``params``/``grads``/``optimizer`` live on the host (CPU offload)."""
        offload = self.engine_config.offload
        if offload == "none" or host_backend:
            return set()
        # offload=optimizer: AdamW state on the host (engines/parallel/host_optimizer.py); params: all three.
        return {"params", "grads", "optimizer"} if offload == "params" else {"optimizer"}


@dataclass
class MemoryEstimate:
    """Bytes per rank; ``host`` names the rows that live in host memory (CPU offload)."""

    rows: dict[str, int]
    host: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The estimate as a fixed-width text table (MiB)."""
        lines = [f"{'per rank':<44} {'MiB':>10}  where"]
        for name, value in self.rows.items():
            lines.append(f"{name:<44} {value / MIB:>10.2f}  {'host' if name in self.host else 'device'}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


FSDP_ROW = "FSDP2 unsharded copies (root + 2 layers, grads)"
STATE_ROWS = {"params": "parameters (sharded, master dtype)", "grads": "gradients (trainable only)",
              "optimizer": "optimizer state (AdamW, trainable only)"}


def estimate_memory(model_config: ModelConfig, engine_config: EngineConfig, world_size: int = 1,
                    tokens: int | None = None, host_backend: bool = False, entropy: bool = True,
                    hf_config=None, patches: int = 0) -> MemoryEstimate:
    """Per-rank memory of one training micro-batch of ``model_config`` under ``engine_config``
    on ``world_size`` ranks, with ``tokens`` per micro-batch (default: the engine's
    ``max_tokens_per_micro_batch``). ``host_backend``: the CPU backend (offload is a no-op);
    ``entropy``: the loss needs the entropy (PPO with an entropy bonus; SFT does not); ``patches``: image patches.
    A whole job's phases: trainer/run/estimate.py."""
    tokens = engine_config.max_tokens_per_micro_batch if tokens is None else tokens
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens: expected an int >= 1 (or set engine.max_tokens_per_micro_batch), got {tokens!r}")
    memory = ModelMemory(model_config, engine_config, world_size, hf_config)
    rows = {STATE_ROWS[key]: getattr(memory, key) for key in STATE_ROWS}
    rows.update(memory.activation_rows(tokens, entropy, patches=patches))
    fsdp = memory.fsdp_forward + memory.fsdp_backward
    if fsdp:
        rows[FSDP_ROW] = fsdp
    host = {STATE_ROWS[key] for key in memory.host_state(host_backend)}
    # The device's peak: what stays on the device plus the step's activations.
    rows["peak step estimate (as configured)"] = sum(rows[name] for name in STATE_ROWS.values() if name not in host) \
        + rows["step activations + head (as configured)"] + fsdp
    estimate = MemoryEstimate(rows, host=host)
    if engine_config.offload == "params" and not host_backend:
        estimate.notes.append("offload=params: parameters, gradients and optimizer state on the host (the peak "
                              "row leaves them out); FSDP2 copies one layer's shards to the device at a time")
    elif engine_config.offload == "optimizer" and not host_backend:
        estimate.notes.append("offload=optimizer: AdamW state on the host (the peak row leaves it out); the step "
                              "copies one parameter's shard and gradient to the host at a time")
    if model_config.lora.enabled:
        estimate.notes.append(f"LoRA rank {model_config.lora.rank}: {memory.num_trainable:,} trained "
                              f"of {memory.num_params:,} parameters; the KL reference (adapters off) "
                              f"costs no second copy")
    return estimate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m polyfsdp.engines.memory", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", help="a preset name (engines/presets.py)")
    which.add_argument("--path", help="a local Hugging Face checkpoint directory (config.json is read)")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--dtype", default="float32", help="master weights: float32 | bfloat16 | float16")
    parser.add_argument("--param-dtype", default="float32", help="compute dtype (FSDP2 mixed precision)")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, required=True, help="tokens per micro-batch")
    parser.add_argument("--patches", type=int, default=0, help="image patches per micro-batch (image tokens x merge^2)")
    parser.add_argument("--freeze-vision", action="store_true", help="model.freeze_vision (the tower's blocks frozen)")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--lora-targets", default="all-linear", help="all-linear or comma-separated module names")
    parser.add_argument("--offload", default="none", help="none | optimizer | params")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--fused", action="store_true", help="use_fused_kernels (no logits tensor)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    model_config = ModelConfig(preset=args.preset, path=args.path, dtype=args.dtype, vocab_size=args.vocab_size,
                               lora=LoraConfig(rank=args.lora_rank, target_modules=targets),
                               freeze_vision=args.freeze_vision)
    engine_config = EngineConfig(param_dtype=args.param_dtype, offload=args.offload,
                                 gradient_checkpointing=args.gradient_checkpointing, use_fused_kernels=args.fused)
    print(estimate_memory(model_config, engine_config, args.world_size, args.tokens, patches=args.patches).table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
