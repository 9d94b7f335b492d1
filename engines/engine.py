"""FSDPEngine: builds and shards the model, computes log-probs/entropy, takes training steps."""
from __future__ import annotations

import logging
import math
import os
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from polyfsdp.backends.base import Backend
from polyfsdp.backends.distributed import init_distributed
from polyfsdp.backends.registry import get_backend

from . import jagged
from .adapters import input_adapter
from .checkpoint import CheckpointMixin
from .config import EngineConfig, ModelConfig
from .flat_batch import FlatBatch, batch_to_flat, flat_to_caller
from .head import FUSED_HEAD_METHOD, IGNORE_INDEX, HeadOptions, fused_head_support, install_fused_head
from .loss_inputs import LossInputs
from .micro_batch import count_micro_batches, merge, split
from .model_builder import build_model
from .optim import build_lr_scheduler, build_optimizer
from .parallelize import parallelize_model
from .token_logprob import logprob_entropy_from_logits

logger = logging.getLogger(__name__)

_TEMPERATURE = "_polyfsdp_temperature"


def _enable_activation_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing per decoder layer (the API was renamed in transformers 5)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class FSDPEngine(CheckpointMixin):
    """One policy (or reference) model under FSDP2. Modes are read from ``engine_config``
    at every call, so one engine can serve every mode combination. Checkpoint methods
    (``save_checkpoint``, ``load_checkpoint``, ``export_hf``) come from CheckpointMixin."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, backend: Backend | None = None,
                 patch_toggles=None):
        if not isinstance(model_config, ModelConfig):
            raise TypeError(f"model_config: expected ModelConfig, got {type(model_config).__name__}")
        if not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config: expected EngineConfig, got {type(engine_config).__name__}")
        self.model_config = model_config
        self.engine_config = engine_config
        self.backend = backend
        self.patch_toggles = patch_toggles
        self.patch_report = None
        self.mesh = None
        self.device: torch.device | None = None
        self.optimizer = None
        self.lr_scheduler = None
        self.global_step = 0
        self._model = None
        self._fused_unsupported: str | None = None
        self._softcap: float | None = None
        self._warned_fallback = False
        self._warned_bf16_master = False

    # ------------------------------------------------------------------ set-up
    def initialize(self) -> "FSDPEngine":
        """Build the model, shard it with FSDP2 on the backend's mesh, create the optimizer."""
        if self._model is not None:
            return self
        self.backend = self.backend or get_backend("auto")
        self.mesh = init_distributed(self.backend)
        self.device = self.backend.device(int(os.environ.get("LOCAL_RANK", "0")))
        model, self.patch_report = build_model(self.model_config, self.backend, self.patch_toggles)
        if self.engine_config.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        self._softcap, self._fused_unsupported = fused_head_support(model)
        install_fused_head(model)
        model.to(self.device)
        parallelize_model(model, self.mesh, self.engine_config, forward_methods=(FUSED_HEAD_METHOD,))
        # Losses are normalised by GLOBAL counts, so rank gradients must be summed, not averaged.
        # Forcing plain SUM collectives avoids PREMUL_SUM, which gloo lacks.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self._model = model
        self.optimizer = build_optimizer(model, self.engine_config)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.engine_config)
        return self

    @property
    def module(self) -> torch.nn.Module:
        """The FSDP2-sharded Hugging Face model."""
        if self._model is None:
            raise RuntimeError("FSDPEngine: call initialize() first")
        return self._model

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

    def forward_flat(self, flat: FlatBatch, temperature, return_entropy: bool = True):
        """Per-token ``(log_probs, entropy)`` of a flat batch (flat ``(total,)``, float32),
        with autograd when enabled. ``temperature``: float or per-token ``(total,)``."""
        if flat.total == 0:
            empty = flat.input_ids.new_zeros(0, dtype=torch.float32)
            return empty, (empty if return_entropy else None)
        adapter = input_adapter(self.engine_config.use_remove_padding)
        labels = jagged.next_token_labels_flat(flat.input_ids, flat.offsets, fill=IGNORE_INDEX)
        inputs = adapter.model_inputs(flat)
        if self._use_fused():
            options = HeadOptions(pack=lambda h: adapter.to_flat(h, flat), temperature=temperature,
                                  return_entropy=return_entropy, softcap=self._softcap)
            return getattr(self.module, FUSED_HEAD_METHOD)(inputs, labels, options)
        logits = self.module(**inputs, use_cache=False).logits
        return logprob_entropy_from_logits(adapter.to_flat(logits, flat), labels, temperature,
                                           return_entropy=return_entropy, ignore_index=IGNORE_INDEX)

    def _prepare(self, batch: TensorDict, temperature, keys) -> tuple[FlatBatch, TensorDict]:
        if not isinstance(batch, TensorDict):
            raise TypeError(f"batch: expected a tensordict.TensorDict, got {type(batch).__name__}")
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        flat = batch_to_flat(batch, self.engine_config.pad_mode, keys=keys)
        self._check_token_ids(flat.input_ids)
        if torch.is_tensor(temperature):
            if temperature.shape != (flat.num_seqs,):
                raise ValueError(f"temperature: expected a float or a ({flat.num_seqs},) tensor, "
                                 f"got shape {tuple(temperature.shape)}")
            temperature = temperature.to(device=flat.offsets.device, dtype=torch.float32)
            if not bool(((temperature > 0) & torch.isfinite(temperature)).all()):
                raise ValueError(f"temperature: every value must be > 0 and finite, got {temperature.tolist()}")
            flat.fields[_TEMPERATURE] = torch.repeat_interleave(temperature, flat.lengths, output_size=flat.total)
        elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or not math.isfinite(temperature):
            raise ValueError(f"temperature: expected a float > 0 (finite) or a (B,) tensor, got {temperature!r}")
        return flat, batch

    def _check_token_ids(self, ids: torch.Tensor) -> None:
        """Integer ids inside the vocabulary (else torch fails deep in the embedding, or with a
        device-side assert on an accelerator). One host read of (min, max) per batch."""
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor; got {ids.dtype}")
        if ids.numel() == 0:
            return
        vocab = self.module.get_input_embeddings().num_embeddings
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab}); got values in [{lo}, {hi}]")

    def infer_batch(self, batch: TensorDict, temperature=1.0, calculate_entropy: bool = True) -> TensorDict:
        """``log_probs`` (and ``entropy``) per token, in the caller's layout: jagged with the
        input's offsets for ``no_padding``; dense ``(B, L)`` zero-padded for ``left_right``."""
        flat, batch = self._prepare(batch, temperature, keys=())
        lp_parts, ent_parts = [], []
        with torch.no_grad(), self.eval_mode():
            for micro, index in self._micro_batches(flat):
                temp = micro.fields.get(_TEMPERATURE, temperature)
                log_probs, entropy = self.forward_flat(micro, temp, calculate_entropy)
                lp_parts.append((log_probs, index))
                ent_parts.append((entropy, index))
        pad_mode = self.engine_config.pad_mode
        out = {"log_probs": flat_to_caller(merge(lp_parts, flat.total), flat, batch, pad_mode)}
        if calculate_entropy:
            out["entropy"] = flat_to_caller(merge(ent_parts, flat.total), flat, batch, pad_mode)
        return TensorDict(out, batch_size=[flat.num_seqs])

    def _micro_batches(self, flat: FlatBatch):
        """Split by the token budget; every rank runs as many micro-batches as the busiest
        one (FSDP's collectives must pair up), padding with placeholders."""
        budget = self.engine_config.max_tokens_per_micro_batch
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return split(flat, budget)
        count = torch.tensor([count_micro_batches(flat, budget)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return split(flat, budget, num_groups=int(count))

    # ------------------------------------------------------------------ training
    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        if not values or not dist.is_initialized() or dist.get_world_size() == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def train_batch(self, batch: TensorDict, loss_fn, temperature=1.0) -> dict[str, float]:
        """One optimizer step on ``batch`` with ``loss_fn`` (contract: engines/loss_inputs.py).

        Returns loss, grad_norm, lr, step_skipped and loss_fn's metrics, each summed over
        micro-batches and ranks (losses and metrics are shares of global counts).
        """
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
        required = tuple(getattr(loss_fn, "required_fields", ()))
        missing = [k for k in required if k not in batch.keys()]
        if missing:
            raise ValueError(f"loss function {type(loss_fn).__name__} needs batch keys {list(required)}; "
                             f"missing {missing} (batch has {sorted(batch.keys())})")
        need_entropy = bool(getattr(loss_fn, "requires_entropy", True))
        flat, batch = self._prepare(batch, temperature, keys=None)
        # The step's token count must come from the mask the loss normalises over.
        mask = flat.fields.get(getattr(loss_fn, "mask_field", "response_mask"))
        local_tokens = float(mask.sum()) if mask is not None else float(flat.total - int((flat.lengths > 0).sum()))
        global_tokens, global_seqs, global_total = self._all_reduce_sum(
            [local_tokens, float(flat.num_seqs), float(flat.total)])
        if global_total == 0:
            raise ValueError("train_batch: the batch holds no tokens (every sequence is empty)")

        model = self.module
        micro_batches = self._micro_batches(flat)
        loss_sum, metric_sums = 0.0, {}
        with self.train_mode():
            for i, (micro, index) in enumerate(micro_batches):
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
                fields = dict(micro.fields)
                temp = fields.pop(_TEMPERATURE, temperature)
                log_probs, entropy = self.forward_flat(micro, temp, need_entropy)
                if index is not None and index.numel() == 0:
                    # A placeholder: join the collectives, contribute nothing.
                    if log_probs.requires_grad:
                        (log_probs.sum() * 0.0).backward()
                    continue
                if micro.total == 0:
                    continue
                inputs = LossInputs(log_probs=log_probs, entropy=entropy, fields=fields, offsets=micro.offsets,
                                    global_num_tokens=global_tokens, global_num_seqs=int(global_seqs),
                                    extras={"seq_fields": micro.seq_fields, "micro_batch": i,
                                            "num_micro_batches": len(micro_batches)})
                loss, metrics = loss_fn(inputs)
                loss.backward()
                loss_sum += float(loss.detach())
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + float(value)
        model.set_requires_gradient_sync(True)

        grad_norm = self._clip_gradients()
        skipped = not math.isfinite(grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if skipped:
            logger.warning("step %d skipped: gradient norm is %s", self.global_step, grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # A skipped step still advances the schedule (the batch is consumed); torch warns
            # about a scheduler step without an optimizer step.
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.step()
        self.global_step += 1

        keys = self._union_keys(metric_sums)
        reduced = self._all_reduce_sum([loss_sum] + [metric_sums.get(k, 0.0) for k in keys])
        result = {"loss": reduced[0], "grad_norm": grad_norm, "lr": lr, "step_skipped": int(skipped)}
        result.update(zip(keys, reduced[1:]))
        return result

    def _union_keys(self, metrics: dict) -> list[str]:
        """Metric names over all ranks (a rank with only placeholder micro-batches has none)."""
        keys = set(metrics)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sorted(keys))
            keys = set().union(*gathered)
        return sorted(keys)

    def _clip_gradients(self) -> float:
        """Global gradient norm over all ranks; clip to ``grad_clip`` when it is finite."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        value = float(norm)
        if self.engine_config.grad_clip is not None and math.isfinite(value):
            torch.nn.utils.clip_grads_with_norm_(params, self.engine_config.grad_clip, norm)
        return value
