"""How a FlatBatch becomes per-token log-probs and entropy: one room for the whole path.

1. Model inputs for the remove-padding mode: :class:`PackedRowInputs` (one ``(1, total)``
   row, position ids restarting per sequence, varlen-attention keywords) or
   :class:`PaddedRowInputs` (right-padded ``(B, L)`` + attention mask); each also maps a
   per-position model output back to flat ``(total, ...)``.
2. Next-token labels per sequence (the last position of each gets ``IGNORE_INDEX``).
3. Either the fused head (decoder body -> flat hidden states -> chunked log-prob/entropy
   against the LM-head weight, never a ``(tokens, vocab)`` logits tensor), installed as a
   method on the root module so FSDP2 gathers its parameters, or the model's logits ->
   :func:`logprob_entropy_from_logits`. Where ``FlatBatch.scored`` names the positions that
   are read, either runs on those rows alone and the rest read 0 (engines/head/rows.py).

Convention: position ``t`` holds ``log p(x[t+1] | x[:t+1]) / T``; the last position is 0
(docs/architecture.md).
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Callable

import torch

# Host copy of ``cu_seq_lens_q`` for attention functions that need the boundaries on the host.
from polyfsdp.backends.base import HOST_CU_SEQ_LENS

from .. import jagged
from ..batch.flat import FlatBatch
from ..batch.images import mrope_positions
from .fused import check_labels_on_host, fused_logprob_entropy
from .fused_loss import FULL_PRECISION, LossOf, fused_logprob_loss
from .rows import KeptRows, kept_rows
from ..jagged import IGNORE_INDEX

FUSED_HEAD_METHOD = "polyfsdp_fused_head"
# Config attributes through which some families rescale logits inside their forward
# (Cohere logit_scale, Granite logits_scaling, Falcon-H1 lm_head_multiplier). The fused
# op does not reproduce them, so those models use the unfused path.
_LOGIT_SCALE_ATTRS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier_scale")


# ----------------------------------------------------------------------------- model inputs
class VisionPositions:
    """A vision-language model's rotary positions (engines/batch/images.py): three rows
    (temporal, height, width) per sequence from the model's own ``get_rope_index``."""

    def __init__(self, model):
        body = model.model
        self.rope_index = body.get_rope_index
        self.image_token_id = model.config.image_token_id
        self.video_token_id = getattr(model.config, "video_token_id", None)
        self.merge = model.config.vision_config.spatial_merge_size

    @staticmethod
    def of(model) -> "VisionPositions | None":
        """For a model with a vision tower (``model.model.visual``), else None."""
        body = getattr(model, "model", None)
        return VisionPositions(model) if getattr(body, "visual", None) is not None else None

    def per_sequence(self, flat: FlatBatch) -> list[torch.Tensor]:
        """Each sequence's ``(3, length)`` positions, on the host: the ids are read back once
        per micro-batch (a device read on accelerators; docs/vision-language.md)."""
        return mrope_positions(self.rope_index, self.image_token_id, self.merge, flat.input_ids, flat.seq_lens,
                               flat.images, self.video_token_id)

    @staticmethod
    def image_inputs(flat: FlatBatch) -> dict:
        """The model's image keywords of ``flat`` (none without images)."""
        return {} if flat.images is None else flat.images.model_inputs()


class PackedRowInputs:
    """remove-padding: one ``(1, total)`` row, position ids restarting per sequence, and the
    ``cu_seq_lens`` keywords varlen attention kernels read. A vision-language model gets four
    position rows: the restarting text positions (transformers finds packed boundaries in
    row 0) above the three mrope rows, each sequence's computed alone."""

    def __init__(self, vision: VisionPositions | None = None):
        self.vision = vision

    def model_inputs(self, flat: FlatBatch) -> dict:
        """Keyword arguments for the model's forward."""
        position_ids = jagged.positions_in_sequences(flat.offsets, flat.total).unsqueeze(0)
        images = {}
        if self.vision is not None:
            mrope = torch.cat(self.vision.per_sequence(flat), dim=1).to(position_ids.device)
            position_ids = torch.cat([position_ids, mrope]).unsqueeze(1)  # (4, 1, total)
            images = self.vision.image_inputs(flat)
        cu = flat.offsets.to(torch.int32)
        host_cu = [0]
        for n in flat.seq_lens:
            host_cu.append(host_cu[-1] + n)
        return {
            **images,
            "input_ids": flat.input_ids.unsqueeze(0),
            "position_ids": position_ids,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": flat.max_len,
            "max_length_k": flat.max_len,
            HOST_CU_SEQ_LENS: host_cu,
        }

    def to_flat(self, output: torch.Tensor, flat: FlatBatch) -> torch.Tensor:
        """``(1, total, ...)`` -> ``(total, ...)``."""
        return output[0]


class PaddedRowInputs:
    """No remove-padding: right-padded ``(B, L)`` with an attention mask. A vision-language
    model gets its three mrope rows ``(3, B, L)`` per row (0 on padding)."""

    def __init__(self, vision: VisionPositions | None = None):
        self.vision = vision

    def model_inputs(self, flat: FlatBatch) -> dict:
        """Keyword arguments for the model's forward."""
        length = max(flat.max_len, 1)
        input_ids = jagged.flat_to_dense(flat.input_ids, flat.offsets, length, padding_value=0)
        positions = torch.arange(length, device=flat.offsets.device)
        attention_mask = (positions[None, :] < flat.lengths[:, None]).to(torch.long)
        if self.vision is None:
            return {"input_ids": input_ids, "attention_mask": attention_mask}
        position_ids = torch.zeros(3, flat.num_seqs, length, dtype=torch.long)
        for row, seq_positions in enumerate(self.vision.per_sequence(flat)):
            position_ids[:, row, :seq_positions.shape[1]] = seq_positions
        return {**self.vision.image_inputs(flat), "input_ids": input_ids, "attention_mask": attention_mask,
                "position_ids": position_ids.to(input_ids.device)}

    def to_flat(self, output: torch.Tensor, flat: FlatBatch) -> torch.Tensor:
        """``(B, L, ...)`` -> ``(total, ...)``, keeping only real tokens."""
        values, _ = jagged.dense_to_flat(output, offsets=flat.offsets, total=flat.total)
        return values


def row_inputs(use_remove_padding: bool, model=None) -> PackedRowInputs | PaddedRowInputs:
    """The model-input layout for a remove-padding setting (with ``model``'s mrope positions
    when it is a vision-language model)."""
    vision = None if model is None else VisionPositions.of(model)
    return PackedRowInputs(vision) if use_remove_padding else PaddedRowInputs(vision)


# ----------------------------------------------------------------------------- fused head
@dataclass
class FusedHeadCall:
    """Non-tensor options of one fused-head call (kept out of FSDP's input handling)."""

    to_flat: Callable[[torch.Tensor], torch.Tensor]
    temperature: float | torch.Tensor
    return_entropy: bool
    softcap: float | None
    impl: str = "eager"
    compile_fallback: bool = False
    # A token-separable loss taken inside the head's forward (engines/head/fused_loss.py):
    # the call then returns ``(loss, metrics)`` instead of ``(log_probs, entropy)``.
    loss_of: LossOf | None = None
    # The rows the head runs on (engines/head/rows.py); None: every real token.
    kept: KeptRows | None = None


def fused_head_support(model) -> tuple[float | None, str | None]:
    """``(softcap, None)`` when the fused head reproduces ``model``'s logits (with that
    final soft-cap, or None), else ``(None, reason)``."""
    config = model.config
    if not isinstance(getattr(model, "model", None), torch.nn.Module):
        return None, f"{type(model).__name__} has no decoder body at .model"
    for name in _LOGIT_SCALE_ATTRS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            return None, f"{type(model).__name__} scales its logits ({name}={value})"
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return None, f"{type(model).__name__}.lm_head is not a plain nn.Linear"
    if head.bias is not None:
        return None, f"{type(model).__name__}.lm_head has a bias"
    softcap = getattr(config, "final_logit_softcapping", None)
    return (float(softcap) if softcap else None), None


def _fused_head(self, model_inputs: dict, labels: torch.Tensor, call: FusedHeadCall):
    """Run the decoder body, flatten its hidden states to real tokens (or to ``call.kept``'s
    rows), apply the fused op."""
    output = self.model(**model_inputs, use_cache=False).last_hidden_state
    kept, temperature, loss_of = call.kept, call.temperature, call.loss_of
    if kept is None:
        hidden = call.to_flat(output)
    else:
        hidden = kept.from_grid(output)
        labels, temperature = kept.take(labels, temperature)
        if loss_of is not None:
            outer = loss_of

            def loss_of(log_probs, entropy):  # the caller's loss reads the flat layout
                return outer(*kept.scatter(log_probs, entropy))
    # Labels and temperatures were validated at the batch edge (engines/batch/checks.py).
    options = dict(temperature=temperature, return_entropy=call.return_entropy, ignore_index=IGNORE_INDEX,
                   softcap=call.softcap, check_values=False, impl=call.impl, compile_fallback=call.compile_fallback)
    weight = self.lm_head.weight
    if loss_of is None:
        log_probs, entropy = fused_logprob_entropy(hidden, weight, labels, **options)
        return (log_probs, entropy) if kept is None else kept.scatter(log_probs, entropy)
    if hidden.dtype in FULL_PRECISION and weight.dtype == hidden.dtype:
        loss, metrics, _, _ = fused_logprob_loss(hidden, weight, labels, loss_of, **options)
        return loss, metrics
    # Low-precision heads keep the 4-GEMM backward (fused_logprob_loss's docstring says why).
    return loss_of(*fused_logprob_entropy(hidden, weight, labels, **options))


def install_fused_head(model) -> None:
    """Attach the fused-head method to this model instance (not its class)."""
    setattr(model, FUSED_HEAD_METHOD, types.MethodType(_fused_head, model))


# ----------------------------------------------------------------------------- unfused
def logprob_entropy_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature, *,
                                return_entropy: bool = True, ignore_index: int = -100, check_values: bool = True):
    """``log_softmax(logits / T)[label]`` and the entropy per row of ``logits (N, V)``;
    rows whose label is ``ignore_index`` give 0 for both. ``temperature``: float or ``(N,)``.
    ``check_values=False`` skips the label-range check (done once at the batch edge)."""
    if check_values:
        check_labels_on_host(labels, logits.shape[-1], ignore_index)
    z = logits.float()
    if torch.is_tensor(temperature):
        z = z / temperature.to(torch.float32).unsqueeze(-1)
    elif temperature != 1.0:
        z = z / float(temperature)
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=picked.dtype, device=picked.device)
    log_probs = torch.where(valid, picked, zero)
    entropy = None
    if return_entropy:
        ent = -(torch.exp(logp) * logp).sum(-1)
        entropy = torch.where(valid, ent, zero)
    return log_probs, entropy


# ----------------------------------------------------------------------------- the path
def _kept(flat: FlatBatch, layout) -> KeptRows | None:
    """The rows of ``flat`` the head runs on in ``layout`` (engines/head/rows.py)."""
    return kept_rows(flat.scored, flat.seq_lens, packed=isinstance(layout, PackedRowInputs),
                     device=flat.input_ids.device)


def _fused_head_call(model, flat: FlatBatch, layout, *, softcap: float | None, return_entropy: bool,
                     fused_impl: tuple[str, bool], loss_of: LossOf | None = None):
    """Run the fused head installed on ``model`` over ``flat`` (see FusedHeadCall)."""
    labels = jagged.next_token_labels_flat(flat.input_ids, flat.offsets, fill=IGNORE_INDEX)
    call = FusedHeadCall(to_flat=lambda h: layout.to_flat(h, flat), temperature=flat.token_temperature(),
                         return_entropy=return_entropy, softcap=softcap, impl=fused_impl[0],
                         compile_fallback=fused_impl[1], loss_of=loss_of, kept=_kept(flat, layout))
    return getattr(model, FUSED_HEAD_METHOD)(layout.model_inputs(flat), labels, call)


def accepts_logits_to_keep(model) -> bool:
    """Whether ``model``'s forward computes logits only at ``logits_to_keep`` (transformers' CausalLMs)."""
    forward = getattr(type(model), "forward", None)
    try:
        return forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def _kept_logits(model, inputs: dict, kept: KeptRows | None, to_flat) -> torch.Tensor:
    """The model's logits at ``kept``'s rows ``(n, V)`` (every real token's without ``kept``),
    asking the model for those logits only when its forward takes ``logits_to_keep``."""
    if kept is None:
        return to_flat(model(**inputs, use_cache=False).logits)
    if accepts_logits_to_keep(model):
        return kept.from_window(model(**inputs, use_cache=False, logits_to_keep=kept.window).logits)
    return kept.from_grid(model(**inputs, use_cache=False).logits)


def forward_loss(model, flat: FlatBatch, loss_of: LossOf, *, use_remove_padding: bool, softcap: float | None,
                 return_entropy: bool, fused_impl: tuple[str, bool] = ("eager", False)):
    """``(loss, metrics)`` of a token-separable ``loss_of(log_probs, entropy)`` on a non-empty
    ``flat`` through the fused head, with the loss gradient taken inside the head's forward
    (engines/head/fused_loss.py); ``loss.backward()`` then only scales the stored gradients."""
    return _fused_head_call(model, flat, row_inputs(use_remove_padding, model), softcap=softcap,
                            return_entropy=return_entropy, fused_impl=fused_impl, loss_of=loss_of)


def forward_logprobs(model, flat: FlatBatch, *, use_remove_padding: bool, fused: bool, softcap: float | None,
                     return_entropy: bool, fused_impl: tuple[str, bool] = ("eager", False)
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``(log_probs, entropy)`` of ``flat`` (flat ``(total,)``, float32), with
    autograd when enabled; ``fused`` selects the fused head (installed on ``model``), whose
    chunk kernels are ``fused_impl = (impl, compile_fallback)`` (see fused_logprob_entropy)."""
    if flat.total == 0:
        empty = flat.input_ids.new_zeros(0, dtype=torch.float32)
        return empty, (empty if return_entropy else None)
    layout = row_inputs(use_remove_padding, model)
    if fused:
        return _fused_head_call(model, flat, layout, softcap=softcap, return_entropy=return_entropy,
                                fused_impl=fused_impl)
    labels = jagged.next_token_labels_flat(flat.input_ids, flat.offsets, fill=IGNORE_INDEX)
    temperature = flat.token_temperature()
    kept = _kept(flat, layout)
    logits = _kept_logits(model, layout.model_inputs(flat), kept, lambda out: layout.to_flat(out, flat))
    if kept is not None:
        labels, temperature = kept.take(labels, temperature)
    log_probs, entropy = logprob_entropy_from_logits(logits, labels, temperature, return_entropy=return_entropy,
                                                     ignore_index=IGNORE_INDEX, check_values=False)
    return (log_probs, entropy) if kept is None else kept.scatter(log_probs, entropy)
