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
from polyfsdp.backends.distributed import all_reduce_max, current_rank, current_world_size, init_distributed
from polyfsdp.backends.registry import get_backend
from polyfsdp.backends.topology import Topology, topology

from .batch.checks import BatchChecks, check_integer_ids
from .cancellation import cancellation_point
from .checkpoint import CheckpointMixin
from .config import EngineConfig, ModelConfig, OptimConfig
from .batch.dp_balance import Balanced, balance, restore
from .batch.flat import FlatBatch, batch_to_flat, flat_to_caller
from .head.fused_compiled import resolve_fused_kernel_impl
from .head.rows import scored_mask
from .heads import ValueHead, head_for
from .model.lora import add_adapters, adapters_disabled
from .losses.inputs import LossInputs, LossNeeds
from .batch.micro import count_micro_batches, is_placeholder, merge, split
from .model.builder import build_model
from .model.vision import patch_cost
from .parallel.offload import host_grad_norm, offload_policy, optimizer_on_host
from .model.optim import build_lr_scheduler, build_optimizer, check_master_dtype
from .parallel.fsdp import gather_fits, gathered, parallelize_model, set_gradient_sync
from .parallel.sequence import check_same_batch, setup_sequence_parallel
from .step_metrics import MAX_SUFFIX, accumulate, reduce_over_ranks

logger = logging.getLogger(__name__)


class FSDPEngine(CheckpointMixin):
    """One policy (or reference) model under FSDP2, or a critic with
    ``ModelConfig(value_head=True)`` (per-token values instead of log-probs:
    :meth:`infer_values`, and ``LossInputs.values`` in training); ``head`` (engines/heads.py)
    does what the two do differently. Modes are read from ``engine_config``
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
        # a rollout engine holding a copy of the weights (trainer/rollout/vllm.py) resyncs on it.
        self.weights_version = 0
        self._model = None
        self.head = head_for(model_config)  # the LM head or a critic's value head (engines/heads.py)
        self._sp = None  # this rank's sequence-parallel group (engines/parallel/sequence.py), or None
        self._offload = None  # FSDP2's CPUOffloadPolicy when EngineConfig.offload moves shards to the host
        self._warned_bf16_master = False
        # Loss and loss metrics since the last optimizer step: device tensors, read in optimizer_step.
        self._pending: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ set-up
    def initialize(self) -> "FSDPEngine":
        """Build the model, shard it with FSDP2 on the backend's mesh, create the optimizer."""
        if self._model is not None:
            return self
        self.backend = self.backend or get_backend("auto")
        fused_impl = resolve_fused_kernel_impl(self.engine_config.fused_kernel_impl, self.backend)
        self.mesh = init_distributed(self.backend)
        self.topology = topology(self.engine_config.ulysses_sp_size, self.backend.device_type)
        self.device = self.backend.device(self.topology.local_rank)
        model, self.patch_report = build_model(self.model_config, self.backend, self.patch_toggles,
                                               compute_dtype=self.engine_config.param_dtype)
        if self.model_config.lora.enabled:
            # After the patches: they edit the base modules, which peft then wraps.
            add_adapters(model, self.model_config.lora, self.model_config.seed)
        self.head.install(model, fused_impl)  # after the adapters: peft never wraps the head
        self._sp = setup_sequence_parallel(model, self.topology)
        self._offload = offload_policy(self.engine_config.offload, self.backend)
        if self._offload is None:
            model.to(self.device)  # with CPU offload FSDP2 keeps the shards on the host
        self._model = parallelize_model(model, self.mesh, self.engine_config,
                                        forward_methods=(self.head.forward_method,), offload_policy=self._offload)
        self.optimizer = build_optimizer(model, self.optim_config,
                                         on_host=optimizer_on_host(self.engine_config.offload, self.backend))
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optim_config)
        return self

    @property
    def is_critic(self) -> bool:
        """Whether the model has a scalar value head instead of the LM head."""
        return isinstance(self.head, ValueHead)

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
        """Run the block with the whole model all-gathered once (engines/parallel/fsdp.py):
        for many small forwards in a row, e.g. decoding steps."""
        return gathered(self.module, self.engine_config.reshard_policy)

    def gather_fits(self) -> bool:
        """Whether holding the full parameters on this rank fits the device's free memory
        (with 20% to spare); True when the backend cannot tell (CPU)."""
        return gather_fits(self.module, self.backend)

    def export_value_head(self, path) -> None:
        """A critic's value head as a safetensors file (``weight``, ``bias``), which
        ``ModelConfig(value_head_path=...)`` loads into a new critic. Collective: call on every rank."""
        self.head.export_value_head(self.module, path, current_rank())

    def load_checkpoint(self, directory, parts: dict | None = None) -> tuple[int, dict | None]:
        """The checkpoint mixin's load (engines/checkpoint/), which also changes the weights
        (this engine's and those of the engines in ``parts``)."""
        loaded = super().load_checkpoint(directory, parts=parts)
        for engine in (self, *(parts or {}).values()):
            engine.weights_version += 1
        return loaded

    # ------------------------------------------------------------------ forward
    def forward_flat(self, flat: FlatBatch, return_entropy: bool = True):
        """Per-token ``(log_probs, entropy)`` of a flat batch on the engine's device (flat
        ``(total,)``, float32), with autograd when enabled (engines/head/forward.py;
        split over the sequence-parallel group with ``ulysses_sp_size > 1``); a critic
        returns ``(values, None)`` (engines/head/value.py)."""
        return self.head.forward(self.module, flat, self.engine_config, self._sp, return_entropy)

    def _to_flat(self, batch: TensorDict, temperature, keys, checks: BatchChecks,
                 scored_field: str | None = None) -> FlatBatch:
        """The edge: caller's layout -> FlatBatch on the device, with value checks queued.
        ``scored_field``: the per-token mask whose positions alone need the head's outputs
        (engines/head/rows.py), taken while the batch is still on the host."""
        if not isinstance(batch, TensorDict):
            raise TypeError(f"batch: expected a tensordict.TensorDict, got {type(batch).__name__}")
        flat = batch_to_flat(batch, self.engine_config.pad_mode, keys=keys)
        if scored_field is not None and scored_field in flat.fields:
            flat.scored = scored_mask(flat.fields[scored_field])
        if self._sp is not None:
            check_same_batch(flat, self._sp)
        flat.set_temperature(temperature)
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
                    adapters: bool = True, mask_field: str | None = None) -> TensorDict:
        """``log_probs`` (and ``entropy``) per token, in the caller's layout: jagged with the
        input's offsets for ``no_padding``; dense ``(B, L)`` zero-padded for ``left_right``.
        ``adapters=False`` runs the base model under LoRA (the KL reference). ``mask_field``: a
        per-token mask of ``batch``; the head runs at its positions alone, every other reads 0."""
        if mask_field is not None and mask_field not in batch.keys():
            raise ValueError(f"infer_batch: batch has no mask_field {mask_field!r} (keys: {sorted(batch.keys())})")
        names = self.head.log_prob_names(calculate_entropy)
        with nullcontext() if adapters else self.adapters_disabled():
            return self._infer(batch, temperature, names, calculate_entropy, mask_field)

    def infer_values(self, batch: TensorDict) -> TensorDict:
        """A critic's ``values`` per token, in the caller's layout (as :meth:`infer_batch`'s
        log-probs): ``values[i][t]`` is the value of the state before token ``t + 1``, the
        last position of every sequence is 0 (engines/head/value.py)."""
        return self._infer(batch, 1.0, self.head.value_names(), False)

    def infer_scores(self, batch: TensorDict) -> torch.Tensor:
        """A reward model's score of each sequence ``(B,)`` float32 (engines/head/score.py: the
        score layer at the sequence's last token), in either pad mode."""
        scores = self._infer(batch, 1.0, self.head.score_names(), False)["scores"]
        # Zero but at each row's last token (and zero-padded in left_right): the row sum is the score.
        if scores.is_nested:
            return torch.stack([row.sum() for row in scores.unbind()]) if scores.size(0) else scores.values()[:0]
        return scores.sum(dim=1)

    def _infer(self, batch: TensorDict, temperature, names: tuple[str, ...], calculate_entropy: bool,
               mask_field: str | None = None) -> TensorDict:
        """The forward's outputs ``names`` (in forward_flat's order) under no_grad, per
        micro-batch, merged and returned in the caller's layout (only under ``mask_field``)."""
        checks = BatchChecks()
        flat = self._to_flat(batch, temperature, () if mask_field is None else (mask_field,), checks, mask_field)
        checks.read()
        balanced = self._balance(flat)
        work = flat if balanced is None else balanced.flat
        parts = {name: [] for name in names}
        with torch.no_grad(), self.eval_mode():
            for micro, index in self._micro_batches(work):
                cancellation_point()
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
        """This replica's share of the step's sequences balanced (balance_dp_tokens, several replicas), else None."""
        if not self.engine_config.balance_dp_tokens or self.topology.dp_size == 1:
            return None
        return balance(flat, self.topology, patch_cost(self.module))  # a vision tower's work weighs too

    def _micro_batches(self, flat: FlatBatch):
        """Split by the token budget; every rank runs as many micro-batches as the busiest
        one (FSDP's collectives must pair up), padding with placeholders."""
        budget = self.engine_config.max_tokens_per_micro_batch
        if current_world_size() == 1:
            return split(flat, budget)
        count = all_reduce_max([float(count_micro_batches(flat, budget))], device=self.device)[0]
        return split(flat, budget, num_groups=int(count))

    # ------------------------------------------------------------------ training
    def forward_backward(self, batch: TensorDict, loss_fn, temperature=1.0) -> dict[str, torch.Tensor]:
        """Forward and backward over ``batch``'s micro-batches; gradients accumulate until
        :meth:`optimizer_step`. ``loss_fn`` follows engines/losses/inputs.py.

        Returns this rank's ``loss`` and loss metrics for the batch as 0-d device tensors
        (shares of global counts, summed over micro-batches; not reduced over ranks). They
        are also accumulated for :meth:`optimizer_step`, which reads and reduces them.
        """
        self._warned_bf16_master = check_master_dtype(self.model_config.dtype, self._warned_bf16_master)
        needs = LossNeeds.of(loss_fn, batch)
        checks = BatchChecks()
        flat = self._to_flat(batch, temperature, None, checks, needs.mask_field if needs.masked_only else None)
        if self.engine_config.check_inputs:
            checks.loss_fields(flat, needs.required, needs.mask_field)
        counts = checks.read_global_counts(flat, needs.mask_field, self.device)  # the step's one host read
        balanced = self._balance(flat)
        sums = self._run_micro_batches(flat if balanced is None else balanced.flat, loss_fn, needs, counts)
        if balanced is not None:
            # max / mean tokens per data-parallel replica (the same on every rank): maxima over the step.
            accumulate(sums, {f"dp_token_imbalance_{key}{MAX_SUFFIX}": torch.tensor(value, dtype=torch.float64)
                              for key, value in (("before", balanced.before), ("after", balanced.after))}, self.device)
        accumulate(self._pending, sums, self.device)
        return sums

    def _run_micro_batches(self, flat: FlatBatch, loss_fn, needs: LossNeeds,
                           counts: tuple[float, int]) -> dict[str, torch.Tensor]:
        """Forward, loss and backward per micro-batch (gradients synced on the last): through the
        head, with the loss inside the fused head when it may; the batch's loss and metrics."""
        micro_batches = self._micro_batches(flat)
        fuse_loss = self.head.fuses_loss(loss_fn, self.engine_config, self._sp)
        sums: dict[str, torch.Tensor] = {}
        with self.train_mode():
            for i, (micro, index) in enumerate(micro_batches):
                cancellation_point()
                set_gradient_sync(self.module, i == len(micro_batches) - 1)
                if is_placeholder(index):
                    self._placeholder_backward(micro, needs.entropy)
                    continue
                if micro.total == 0:
                    continue
                loss_of = self._loss_of(loss_fn, micro, counts, (i, len(micro_batches)))
                if fuse_loss:
                    loss, metrics = self.head.forward_loss(self.module, micro, loss_of, self.engine_config,
                                                           needs.entropy)
                else:
                    loss, metrics = loss_of(*self.forward_flat(micro, needs.entropy))
                loss.backward()
                accumulate(sums, {"loss": loss, **metrics}, self.device)
        set_gradient_sync(self.module, True)
        return sums

    def _placeholder_backward(self, micro: FlatBatch, return_entropy: bool) -> None:
        """A placeholder micro-batch: join the forward's and backward's collectives, contribute nothing."""
        outputs, _ = self.forward_flat(micro, return_entropy)
        if outputs.requires_grad:
            (outputs.sum() * 0.0).backward()

    def _loss_of(self, loss_fn, micro: FlatBatch, counts: tuple[float, int], position: tuple[int, int]):
        """``loss_of(first, second)``: ``loss_fn`` on one micro-batch, the head's two outputs put
        where they belong in ``LossInputs``; ``position`` is (micro-batch, of how many)."""
        def loss_of(first, second):
            return loss_fn(LossInputs(**self.head.loss_outputs(first, second), fields=dict(micro.fields),
                                      offsets=micro.offsets, global_num_tokens=counts[0], global_num_seqs=counts[1],
                                      extras={"seq_fields": micro.seq_fields, "micro_batch": position[0],
                                              "num_micro_batches": position[1]}))
        return loss_of

    def optimizer_step(self) -> dict[str, float]:
        """Clip the gradients, step AdamW unless their norm is not finite, zero them.

        Returns ``grad_norm``, ``lr`` (the rate this step used), ``step_skipped`` and the loss
        and metrics accumulated by ``forward_backward`` since the last step, summed over
        ranks; all of it comes to the host in one read. Advances ``global_step``.
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        keys, values = reduce_over_ranks(self._pending, self.device)
        norm = self._grad_norm(params)
        # With CPU offload the gradients (and their norm) live on the host.
        norm_here = norm.reshape(1).to(device=self.device, dtype=torch.float64)
        grad_norm, *values = torch.cat([norm_here, values]).tolist()
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

    def _grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Global gradient L2 norm over all ranks, as a device tensor (0 without gradients)."""
        if not params:
            return torch.zeros((), device=self.device)
        if self._offload is not None:
            return host_grad_norm([p.grad for p in params], self.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
