"""FSDPEngine: builds and shards the model, computes log-probs/entropy, takes training steps.

Training is split the way verl's engines are: :meth:`FSDPEngine.forward_backward` runs a
batch's micro-batches and accumulates gradients (call it several times to accumulate over
batches), :meth:`FSDPEngine.optimizer_step` clips, skips a non-finite step, steps and zeroes
the gradients, and :meth:`FSDPEngine.lr_scheduler_step` advances the schedule;
:meth:`FSDPEngine.train_batch` is the three in one call. Batch values are validated once per
batch at the edge, and metrics stay on the device until ``optimizer_step`` reads them all at
once (docs/architecture.md).
"""
from __future__ import annotations

import logging
import math
import warnings
from contextlib import contextmanager, nullcontext

import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from polyfsdp.backends.base import Backend
from polyfsdp.backends.distributed import (all_gather_object, all_reduce_max, all_reduce_sum, current_rank,
                                           current_world_size, init_distributed)
from polyfsdp.backends.registry import get_backend
from polyfsdp.backends.topology import Topology, topology

from .batch_checks import BatchChecks, check_integer_ids
from .checkpoint import CheckpointMixin
from .config import EngineConfig, ModelConfig, OptimConfig
from .dp_balance import Balanced, balance, restore
from .flat_batch import FlatBatch, batch_to_flat, flat_to_caller
from .forward_logprobs import (FUSED_HEAD_METHOD, forward_logprobs, forward_loss, fused_head_support,
                               install_fused_head)
from .fused_logprob_compiled import resolve_fused_kernel_impl
from .lora import add_adapters, adapters_disabled
from .loss_inputs import LossInputs
from .losses import is_token_separable
from .micro_batch import count_micro_batches, is_placeholder, merge, split
from .model_builder import build_model
from .offload import host_grad_norm, offload_policy, optimizer_on_host
from .optim import build_lr_scheduler, build_optimizer
from .parallelize import gathered, parallelize_model, set_gradient_sync
from .sequence_parallel import check_same_batch, setup_sequence_parallel, sp_forward_logprobs, sp_forward_values
from .value_head import VALUE_HEAD_METHOD, export_value_head, forward_values, install_value_head

logger = logging.getLogger(__name__)


# Loss metrics whose name ends with this are maxima: combined by max over micro-batches,
# batches and ranks instead of summed (engines/losses.py).
MAX_SUFFIX = "_max"


def _combine(key: str, total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """Accumulate one metric: a sum of shares, or a maximum for ``*_max`` keys."""
    if total is None:
        return value
    return torch.maximum(total, value) if key.endswith(MAX_SUFFIX) else total + value


class FSDPEngine(CheckpointMixin):
    """One policy (or reference) model under FSDP2, or a critic with
    ``ModelConfig(value_head=True)`` (per-token values instead of log-probs:
    :meth:`infer_values`, and ``LossInputs.values`` in training). Modes are read from ``engine_config``
    at every call, so one engine can serve every mode combination; ``optim_config``
    (default ``OptimConfig()``) sets AdamW and its schedule. Checkpoint methods
    (``save_checkpoint``, ``load_checkpoint``, ``export_hf``) come from CheckpointMixin."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, optim_config: OptimConfig | None = None,
                 backend: Backend | None = None, patch_toggles=None):
        if not isinstance(model_config, ModelConfig):
            raise TypeError(f"model_config: expected ModelConfig, got {type(model_config).__name__}")
        if not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config: expected EngineConfig, got {type(engine_config).__name__}")
        optim_config = OptimConfig() if optim_config is None else optim_config
        if not isinstance(optim_config, OptimConfig):
            raise TypeError(f"optim_config: expected OptimConfig or None, got {type(optim_config).__name__}")
        self.model_config = model_config
        self.engine_config = engine_config
        self.optim_config = optim_config
        self.backend = backend
        self.patch_toggles = patch_toggles
        self.patch_report = None
        self.mesh = None
        self.topology: Topology | None = None  # ranks, replicas and SP groups (backends/topology.py)
        self.device: torch.device | None = None
        self.optimizer = None
        self.lr_scheduler = None
        self.global_step = 0
        # Bumped whenever the weights change (an applied optimizer step, a checkpoint load):
        # a rollout engine holding a copy of the weights (trainer/vllm_rollout.py) resyncs on it.
        self.weights_version = 0
        self._model = None
        self._fused_unsupported: str | None = None
        self._sp = None  # this rank's sequence-parallel group (engines/sequence_parallel.py), or None
        self._offload = None  # FSDP2's CPUOffloadPolicy when EngineConfig.offload moves shards to the host
        self._softcap: float | None = None
        self._fused_impl: tuple[str, bool] = ("eager", False)
        self._warned_fallback = False
        self._warned_bf16_master = False
        # Loss and loss metrics since the last optimizer step: device tensors, read in optimizer_step.
        self._pending: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ set-up
    def initialize(self) -> "FSDPEngine":
        """Build the model, shard it with FSDP2 on the backend's mesh, create the optimizer."""
        if self._model is not None:
            return self
        self.backend = self.backend or get_backend("auto")
        self._fused_impl = resolve_fused_kernel_impl(self.engine_config.fused_kernel_impl, self.backend)
        self.mesh = init_distributed(self.backend)
        self.topology = topology(self.engine_config.ulysses_sp_size, self.backend.device_type)
        self.device = self.backend.device(self.topology.local_rank)
        model, self.patch_report = build_model(self.model_config, self.backend, self.patch_toggles,
                                               compute_dtype=self.engine_config.param_dtype)
        if self.model_config.lora.enabled:
            # After the patches: they edit the base modules, which peft then wraps.
            add_adapters(model, self.model_config.lora, self.model_config.seed)
        if self.is_critic:
            # After the adapters: peft froze every base weight, and the new head (trainable)
            # then trains beside the adapters; it is never wrapped by peft.
            install_value_head(model, self.model_config.value_head_init_std, self.model_config.seed,
                               self.model_config.value_head_path)
            head_method = VALUE_HEAD_METHOD
        else:
            self._softcap, self._fused_unsupported = fused_head_support(model)
            install_fused_head(model)
            head_method = FUSED_HEAD_METHOD
        self._sp = setup_sequence_parallel(model, self.topology)
        self._offload = offload_policy(self.engine_config.offload, self.backend)
        if self._offload is None:
            model.to(self.device)  # with CPU offload FSDP2 keeps the shards on the host
        self._model = parallelize_model(model, self.mesh, self.engine_config, forward_methods=(head_method,),
                                        offload_policy=self._offload)
        self.optimizer = build_optimizer(model, self.optim_config,
                                         on_host=optimizer_on_host(self.engine_config.offload, self.backend))
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim_config)
        return self

    @property
    def is_critic(self) -> bool:
        """Whether the model has a scalar value head instead of the LM head."""
        return self.model_config.value_head

    @property
    def module(self) -> torch.nn.Module:
        """The Hugging Face model: FSDP2-sharded, or plain on one rank (EngineConfig.shard_single_rank)."""
        if self._model is None:
            raise RuntimeError("FSDPEngine: call initialize() first")
        return self._model

    def parameter_counts(self) -> tuple[int, int]:
        """(trained, all) parameters of the whole model, every rank's shards together (a DTensor's
        ``numel`` is its global size): LoRA trains its adapters only."""
        params = list(self.module.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def train_mode(self):
        """Run the block with the model in training mode (restored afterwards)."""
        return self._mode(training=True)

    def eval_mode(self):
        """Run the block with the model in eval mode (restored afterwards)."""
        return self._mode(training=False)

    @contextmanager
    def _mode(self, training: bool):
        previous = self.module.training
        self.module.train(training)
        try:
            yield self
        finally:
            self.module.train(previous)

    def gathered(self):
        """Run the block with the whole model all-gathered once (engines/parallelize.py):
        for many small forwards in a row, e.g. decoding steps."""
        return gathered(self.module, self.engine_config.reshard_policy)

    def gather_fits(self) -> bool:
        """Whether holding the full parameters on this rank fits the device's free memory
        (with 20% to spare); True when the backend cannot tell (CPU)."""
        free = self.backend.free_memory_bytes()
        if free is None:
            return True
        extra = sum(p.numel() * p.element_size() for p in self.module.parameters())
        extra -= sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else 0
                     for p in self.module.parameters())
        return extra * 1.2 <= free

    def export_value_head(self, path) -> None:
        """A critic's value head as a safetensors file (``weight``, ``bias``), which
        ``ModelConfig(value_head_path=...)`` loads into a new critic. Collective: call on every rank."""
        if not self.is_critic:
            raise ValueError("export_value_head: this engine has no value head (ModelConfig.value_head=False)")
        export_value_head(self.module, path, current_rank())

    def load_checkpoint(self, directory, parts: dict | None = None) -> tuple[int, dict | None]:
        """The checkpoint mixin's load (engines/checkpoint.py), which also changes the weights
        (this engine's and those of the engines in ``parts``)."""
        loaded = super().load_checkpoint(directory, parts=parts)
        for engine in (self, *(parts or {}).values()):
            engine.weights_version += 1
        return loaded

    # ------------------------------------------------------------------ forward
    def _use_fused(self) -> bool:
        if not self.engine_config.use_fused_kernels:
            return False
        if self._fused_unsupported is None:
            return True
        if not self._warned_fallback:
            logger.warning("use_fused_kernels=True but %s: using the unfused log-prob path for this model",
                           self._fused_unsupported)
            self._warned_fallback = True
        return False

    def forward_flat(self, flat: FlatBatch, return_entropy: bool = True):
        """Per-token ``(log_probs, entropy)`` of a flat batch on the engine's device (flat
        ``(total,)``, float32), with autograd when enabled (engines/forward_logprobs.py;
        split over the sequence-parallel group with ``ulysses_sp_size > 1``); a critic
        returns ``(values, None)`` (engines/value_head.py)."""
        if self.is_critic and self._sp is not None:
            return sp_forward_values(self.module, flat, use_remove_padding=self.engine_config.use_remove_padding,
                                     sp=self._sp), None
        if self.is_critic:
            return forward_values(self.module, flat, use_remove_padding=self.engine_config.use_remove_padding), None
        if self._sp is not None:
            return sp_forward_logprobs(self.module, flat, use_remove_padding=self.engine_config.use_remove_padding,
                                       fused=self._use_fused(), softcap=self._softcap, return_entropy=return_entropy,
                                       sp=self._sp, fused_impl=self._fused_impl)
        return forward_logprobs(self.module, flat, use_remove_padding=self.engine_config.use_remove_padding,
                                fused=self._use_fused(), softcap=self._softcap, return_entropy=return_entropy,
                                fused_impl=self._fused_impl)

    def _fuses_loss(self, loss_fn) -> bool:
        """Whether ``loss_fn`` is taken inside the fused head's forward (3 GEMMs instead of 4,
        engines/fused_logprob_loss.py): ``fuse_loss_into_head`` is on, the fused head serves
        this model, and the loss declares itself token-separable. A critic, sequence
        parallelism and any other loss keep the head's outputs -> loss -> backward path."""
        return (self.engine_config.fuse_loss_into_head and not self.is_critic and self._sp is None
                and is_token_separable(loss_fn) and self._use_fused())

    def _to_flat(self, batch: TensorDict, temperature, keys, checks: BatchChecks) -> FlatBatch:
        """The edge: caller's layout -> FlatBatch on the device, with value checks queued."""
        if not isinstance(batch, TensorDict):
            raise TypeError(f"batch: expected a tensordict.TensorDict, got {type(batch).__name__}")
        flat = batch_to_flat(batch, self.engine_config.pad_mode, keys=keys)
        if self._sp is not None:
            check_same_batch(flat, self._sp)
        if torch.is_tensor(temperature):
            if temperature.shape != (flat.num_seqs,):
                raise ValueError(f"temperature: expected a float or a ({flat.num_seqs},) tensor, "
                                 f"got shape {tuple(temperature.shape)}")
            flat.temperature = temperature.to(dtype=torch.float32)
        elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or not math.isfinite(temperature):
            raise ValueError(f"temperature: expected a float > 0 (finite) or a (B,) tensor, got {temperature!r}")
        else:
            flat.temperature = float(temperature)
        flat = flat.to(self.device)  # tensors already on the device are kept, not copied
        if self.engine_config.check_inputs:
            checks.token_ids(flat.input_ids, self.module.get_input_embeddings().num_embeddings)
            if torch.is_tensor(flat.temperature):
                checks.temperatures(flat.temperature)
        else:
            check_integer_ids(flat.input_ids)
        return flat

    def adapters_disabled(self):
        """Run the block with the LoRA adapters off: the frozen base model, e.g. the reference
        policy for KL without a second model (a no-op without LoRA)."""
        return adapters_disabled(self.module)

    def infer_batch(self, batch: TensorDict, temperature=1.0, calculate_entropy: bool = True,
                    adapters: bool = True) -> TensorDict:
        """``log_probs`` (and ``entropy``) per token, in the caller's layout: jagged with the
        input's offsets for ``no_padding``; dense ``(B, L)`` zero-padded for ``left_right``.
        ``adapters=False`` runs the base model under LoRA (the KL reference)."""
        if self.is_critic:
            raise ValueError("infer_batch: this engine is a critic (ModelConfig.value_head=True); use infer_values")
        names = ("log_probs", "entropy") if calculate_entropy else ("log_probs",)
        with nullcontext() if adapters else self.adapters_disabled():
            return self._infer(batch, temperature, names, calculate_entropy)

    def infer_values(self, batch: TensorDict) -> TensorDict:
        """A critic's ``values`` per token, in the caller's layout (as :meth:`infer_batch`'s
        log-probs): ``values[i][t]`` is the value of the state before token ``t + 1``, the
        last position of every sequence is 0 (engines/value_head.py)."""
        if not self.is_critic:
            raise ValueError("infer_values: this engine has no value head; build it with ModelConfig(value_head=True)")
        return self._infer(batch, 1.0, ("values",), False)

    def _infer(self, batch: TensorDict, temperature, names: tuple[str, ...], calculate_entropy: bool) -> TensorDict:
        """The forward's outputs ``names`` (in forward_flat's order) under no_grad, per
        micro-batch, merged and returned in the caller's layout."""
        checks = BatchChecks()
        flat = self._to_flat(batch, temperature, (), checks)
        checks.read()
        balanced = self._balance(flat)
        work = flat if balanced is None else balanced.flat
        parts = {name: [] for name in names}
        with torch.no_grad(), self.eval_mode():
            for micro, index in self._micro_batches(work):
                for name, value in zip(names, self.forward_flat(micro, calculate_entropy)):
                    parts[name].append((value, index))

        def to_caller(part):
            values = merge(part, work.total)
            if balanced is not None:
                values = restore(values, balanced, flat, self.topology)
            return flat_to_caller(values, flat, batch, self.engine_config.pad_mode)

        out = {name: to_caller(part) for name, part in parts.items()}
        return TensorDict(out, batch_size=[flat.num_seqs])

    def _balance(self, flat: FlatBatch) -> Balanced | None:
        """With ``balance_dp_tokens`` and several data-parallel replicas: this replica's share
        of the step's sequences, balanced by tokens (engines/dp_balance.py); else None."""
        if not self.engine_config.balance_dp_tokens or self.topology.dp_size == 1:
            return None
        return balance(flat, self.topology)

    def _micro_batches(self, flat: FlatBatch):
        """Split by the token budget; every rank runs as many micro-batches as the busiest
        one (FSDP's collectives must pair up), padding with placeholders."""
        budget = self.engine_config.max_tokens_per_micro_batch
        if current_world_size() == 1:
            return split(flat, budget)
        count = all_reduce_max([float(count_micro_batches(flat, budget))], device=self.device)[0]
        return split(flat, budget, num_groups=int(count))

    # ------------------------------------------------------------------ training
    def _check_trainable(self) -> None:
        if self.model_config.dtype == "float16":
            # AdamW's eps (1e-8) rounds to 0 in float16: a zero gradient gives 0/0 = NaN weights.
            raise ValueError("train_batch: ModelConfig.dtype='float16' keeps the master weights in float16, "
                             "which AdamW turns into NaN; use ModelConfig.dtype='float32' with "
                             "EngineConfig.param_dtype='float16' (float16 compute, float32 weights)")
        if self.model_config.dtype == "bfloat16" and not self._warned_bf16_master:
            # bf16 keeps ~3 significant digits: lr-sized AdamW updates mostly round away.
            logger.warning("train_batch: ModelConfig.dtype='bfloat16' keeps the master weights in bfloat16, "
                           "where small updates round to nothing; for training prefer ModelConfig.dtype="
                           "'float32' with EngineConfig.param_dtype='bfloat16'")
            self._warned_bf16_master = True

    def _global_counts(self, flat: FlatBatch, mask_field: str, checks: BatchChecks) -> tuple[float, int]:
        """The step's (tokens, sequences) over all ranks, read with the value checks in one go.
        Tokens are the loss's mask sum (or every position with a next token, without the mask)."""
        mask = flat.fields.get(mask_field)
        if mask is not None:
            tokens = mask.sum(dtype=torch.float64)
        else:
            tokens = torch.tensor(float(flat.total - sum(1 for n in flat.seq_lens if n > 0)), dtype=torch.float64)
        counts = torch.cat([tokens.reshape(1).to(self.device),
                            torch.tensor([flat.num_seqs, flat.total], dtype=torch.float64, device=self.device)])
        all_reduce_sum(counts)
        global_tokens, global_seqs, global_total = checks.read(counts)
        if global_total == 0:
            raise ValueError("train_batch: the batch holds no tokens (every sequence is empty)")
        return global_tokens, int(global_seqs)

    def forward_backward(self, batch: TensorDict, loss_fn, temperature=1.0) -> dict[str, torch.Tensor]:
        """Forward and backward over ``batch``'s micro-batches; gradients accumulate until
        :meth:`optimizer_step`. ``loss_fn`` follows engines/loss_inputs.py.

        Returns this rank's ``loss`` and loss metrics for the batch as 0-d device tensors
        (shares of global counts, summed over micro-batches; not reduced over ranks). They
        are also accumulated for :meth:`optimizer_step`, which reads and reduces them.
        """
        self._check_trainable()
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable taking LossInputs and returning (loss, metrics), such as "
                            f"SFTLoss() or PPOLoss(); got {loss_fn!r}")
        required = tuple(getattr(loss_fn, "required_fields", ()))
        missing = [k for k in required if k not in batch.keys()]
        if missing:
            raise ValueError(f"loss function {type(loss_fn).__name__} needs batch keys {list(required)}; "
                             f"missing {missing} (batch has {sorted(batch.keys())})")
        need_entropy = bool(getattr(loss_fn, "requires_entropy", True))
        mask_field = getattr(loss_fn, "mask_field", "response_mask")
        checks = BatchChecks()
        flat = self._to_flat(batch, temperature, None, checks)
        if self.engine_config.check_inputs:
            for name in required:
                value = flat.fields.get(name)
                if value is not None and name == mask_field:
                    checks.zero_one(name, value, flat.offsets)
                elif value is not None:
                    checks.finite(name, value, flat.offsets)
        global_tokens, global_seqs = self._global_counts(flat, mask_field, checks)
        balanced = self._balance(flat)
        if balanced is not None:
            flat = balanced.flat

        model = self.module
        micro_batches = self._micro_batches(flat)
        fuse_loss = self._fuses_loss(loss_fn)
        sums: dict[str, torch.Tensor] = {}
        with self.train_mode():
            for i, (micro, index) in enumerate(micro_batches):
                set_gradient_sync(model, i == len(micro_batches) - 1)

                def loss_of(log_probs, entropy, micro=micro, i=i):
                    # A critic's forward gives values where a policy's gives log-probs.
                    return loss_fn(LossInputs(log_probs=None if self.is_critic else log_probs, entropy=entropy,
                                              values=log_probs if self.is_critic else None,
                                              fields=dict(micro.fields), offsets=micro.offsets,
                                              global_num_tokens=global_tokens, global_num_seqs=global_seqs,
                                              extras={"seq_fields": micro.seq_fields, "micro_batch": i,
                                                      "num_micro_batches": len(micro_batches)}))

                if fuse_loss and micro.total > 0 and not is_placeholder(index):
                    loss, metrics = forward_loss(model, micro, loss_of,
                                                 use_remove_padding=self.engine_config.use_remove_padding,
                                                 softcap=self._softcap, return_entropy=need_entropy,
                                                 fused_impl=self._fused_impl)
                    loss.backward()
                else:
                    log_probs, entropy = self.forward_flat(micro, need_entropy)
                    if is_placeholder(index):
                        # A placeholder: join the collectives, contribute nothing.
                        if log_probs.requires_grad:
                            (log_probs.sum() * 0.0).backward()
                        continue
                    if micro.total == 0:
                        continue
                    loss, metrics = loss_of(log_probs, entropy)
                    loss.backward()
                for key, value in {"loss": loss, **metrics}.items():
                    value = torch.as_tensor(value).detach().to(device=self.device, dtype=torch.float64)
                    sums[key] = _combine(key, sums.get(key), value)
        set_gradient_sync(model, True)
        if balanced is not None:
            # max / mean tokens per data-parallel replica (the same on every rank): maxima over the step.
            for key, value in (("before", balanced.before), ("after", balanced.after)):
                sums[f"dp_token_imbalance_{key}{MAX_SUFFIX}"] = torch.tensor(value, dtype=torch.float64,
                                                                             device=self.device)
        for key, value in sums.items():
            self._pending[key] = _combine(key, self._pending.get(key), value)
        return sums

    def optimizer_step(self) -> dict[str, float]:
        """Clip the gradients, step AdamW unless their norm is not finite, zero them.

        Returns ``grad_norm``, ``lr`` (the rate this step used), ``step_skipped`` and the loss
        and metrics accumulated by ``forward_backward`` since the last step, summed over
        ranks; all of it comes to the host in one read. Advances ``global_step``.
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        keys = self._union_keys(self._pending)
        # Metrics named *_max are maxima (of non-negative values), reduced by max; the rest are shares, summed.
        reduced = []
        for maxima, reduce in ((False, all_reduce_sum), (True, all_reduce_max)):
            group = [k for k in keys if k.endswith(MAX_SUFFIX) == maxima]
            values = torch.stack([self._pending.get(k, torch.zeros((), dtype=torch.float64, device=self.device))
                                  for k in group]) if group else torch.zeros(0, dtype=torch.float64, device=self.device)
            if group:
                reduce(values)
            reduced.append((group, values))
        keys = reduced[0][0] + reduced[1][0]
        norm = self._grad_norm(params)
        # With CPU offload the gradients (and their norm) live on the host.
        norm_here = norm.reshape(1).to(device=self.device, dtype=torch.float64)
        grad_norm, *values = torch.cat([norm_here, reduced[0][1], reduced[1][1]]).tolist()
        self._pending = {}
        skipped = not math.isfinite(grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if skipped:
            logger.warning("step %d skipped: gradient norm is %s", self.global_step, grad_norm)
        else:
            if self.optim_config.grad_clip is not None and params:
                torch.nn.utils.clip_grads_with_norm_(params, self.optim_config.grad_clip, norm)
            self.optimizer.step()
            self.weights_version += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        result = {"loss": 0.0, **dict(zip(keys, values))}
        result.update(grad_norm=grad_norm, lr=lr, step_skipped=int(skipped))
        return result

    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule by one step; returns the new rate."""
        with warnings.catch_warnings():
            # A skipped step still advances the schedule (the batch is consumed); torch warns
            # about a scheduler step without an optimizer step.
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.step()
        return self.optimizer.param_groups[0]["lr"]

    def train_batch(self, batch: TensorDict, loss_fn, temperature=1.0) -> dict[str, float]:
        """One optimizer step on ``batch``: :meth:`forward_backward`, :meth:`optimizer_step`,
        :meth:`lr_scheduler_step`. Returns loss, grad_norm, lr, step_skipped and loss_fn's
        metrics, each summed over micro-batches and ranks (shares of global counts)."""
        self.forward_backward(batch, loss_fn, temperature)
        metrics = self.optimizer_step()
        self.lr_scheduler_step()
        return metrics

    def _union_keys(self, metrics: dict) -> list[str]:
        """Metric names over all ranks (a rank with only placeholder micro-batches has none)."""
        return sorted(set().union(*all_gather_object(sorted(metrics))))

    def _grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Global gradient L2 norm over all ranks, as a device tensor (0 without gradients)."""
        if not params:
            return torch.zeros((), device=self.device)
        if self._offload is not None:
            return host_grad_norm([p.grad for p in params], self.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
