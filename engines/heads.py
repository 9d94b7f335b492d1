"""The engine's heads: everything a policy engine and a critic engine do differently.

:class:`FSDPEngine` builds one body, shards it, splits batches and steps the optimizer the same
way for both; it holds one head (:func:`head_for` picks it from ``ModelConfig.value_head``) and
asks it wherever the two differ (docs/architecture.md, "Heads"):

- set-up: what the model's output layer becomes (the LM head keeps ``lm_head`` and gains the
  fused log-prob method; the value head replaces ``lm_head`` by ``hidden -> 1``) and which root
  method FSDP2 registers as a forward;
- forward: how a flat batch becomes per-token outputs, ``(log_probs, entropy)`` through the
  fused head or the logits, or ``(values, None)``, with or without sequence parallelism;
- training: whether a loss may run inside the fused head's forward, and which ``LossInputs``
  fields the outputs fill (a critic's go to ``values``, its ``log_probs`` are None);
- inference and export: which of ``infer_batch``/``infer_values`` it serves, and whether it
  has a value head to export.
"""
from __future__ import annotations

import logging

import torch

from .config import EngineConfig, ModelConfig
from .batch.flat import FlatBatch
from .head.forward import FUSED_HEAD_METHOD, forward_logprobs, forward_loss, fused_head_support, install_fused_head
from .losses.inputs import is_token_separable
from .parallel.sequence import sp_forward_logprobs, sp_forward_values
from .head.score import SCORE_HEAD_METHOD, forward_scores, install_score_head
from .head.value import VALUE_HEAD_METHOD, export_value_head, forward_values, install_value_head

logger = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, torch.Tensor | None]


class LMHead:
    """A causal LM's vocabulary head: per-token log-probs and entropy (a policy or a reference)."""

    forward_method = FUSED_HEAD_METHOD

    def __init__(self):
        self.fused_impl: tuple[str, bool] = ("eager", False)  # the fused head's chunk kernels
        self.softcap: float | None = None  # the model's final logit soft-cap, which the fused head applies
        self.fused_unsupported: str | None = None  # why the fused head cannot reproduce this model's logits
        self._warned_fallback = False

    def install(self, model: torch.nn.Module, fused_impl: tuple[str, bool]) -> None:
        """Attach the fused log-prob method to the built model (after LoRA, before FSDP2), whose
        chunk kernels are ``fused_impl = (impl, compile_fallback)`` as the engine resolved them for
        its backend (engines/head/fused_compiled.py)."""
        self.fused_impl = fused_impl
        self.softcap, self.fused_unsupported = fused_head_support(model)
        install_fused_head(model)

    def uses_fused(self, modes: EngineConfig) -> bool:
        """``use_fused_kernels``, unless the fused head does not fit this model (logged once)."""
        if not modes.use_fused_kernels:
            return False
        if self.fused_unsupported is None:
            return True
        if not self._warned_fallback:
            logger.warning("use_fused_kernels=True but %s: using the unfused log-prob path for this model",
                           self.fused_unsupported)
            self._warned_fallback = True
        return False

    def forward(self, model, flat: FlatBatch, modes: EngineConfig, sp, return_entropy: bool) -> Outputs:
        """``(log_probs, entropy)`` flat ``(total,)`` (engines/head/forward.py; split over the
        sequence-parallel group ``sp`` when there is one)."""
        options = dict(use_remove_padding=modes.use_remove_padding, fused=self.uses_fused(modes), softcap=self.softcap,
                       return_entropy=return_entropy, fused_impl=self.fused_impl)
        if sp is not None:
            return sp_forward_logprobs(model, flat, sp=sp, **options)
        return forward_logprobs(model, flat, **options)

    def fuses_loss(self, loss_fn, modes: EngineConfig, sp) -> bool:
        """Whether ``loss_fn`` is taken inside the fused head's forward (3 GEMMs instead of 4,
        engines/head/fused_loss.py): ``fuse_loss_into_head`` is on, the fused head serves this
        model, and the loss declares itself token-separable. Sequence parallelism and any other
        loss keep the head's outputs -> loss -> backward path."""
        return (modes.fuse_loss_into_head and sp is None and is_token_separable(loss_fn)
                and self.uses_fused(modes))

    def forward_loss(self, model, flat: FlatBatch, loss_of, modes: EngineConfig, return_entropy: bool):
        """``(loss, metrics)`` of ``loss_of(log_probs, entropy)`` with its gradient taken in the head."""
        return forward_loss(model, flat, loss_of, use_remove_padding=modes.use_remove_padding, softcap=self.softcap,
                            return_entropy=return_entropy, fused_impl=self.fused_impl)

    @staticmethod
    def loss_outputs(first: torch.Tensor, second: torch.Tensor | None) -> dict:
        """The ``LossInputs`` fields :meth:`forward`'s outputs fill."""
        return {"log_probs": first, "entropy": second}

    @staticmethod
    def log_prob_names(calculate_entropy: bool) -> tuple[str, ...]:
        """What ``infer_batch`` returns, in :meth:`forward`'s order."""
        return ("log_probs", "entropy") if calculate_entropy else ("log_probs",)

    @staticmethod
    def value_names() -> tuple[str, ...]:
        raise ValueError("infer_values: this engine has no value head; build it with ModelConfig(value_head=True)")

    @staticmethod
    def score_names() -> tuple[str, ...]:
        raise ValueError("infer_scores: this engine has no score head; build it with ModelConfig(score_head=True)")

    @staticmethod
    def export_value_head(model, path, rank: int) -> None:
        raise ValueError("export_value_head: this engine has no value head (ModelConfig.value_head=False)")


class ValueHead:
    """A critic's scalar head in ``lm_head``'s place (engines/head/value.py): one value per token.
    No vocabulary, so the fused head and its loss-in-head path do not apply."""

    forward_method = VALUE_HEAD_METHOD

    def __init__(self, init_std: float, seed: int, path: str | None = None):
        self.init_std, self.seed, self.path = init_std, seed, path

    def install(self, model: torch.nn.Module, fused_impl: tuple[str, bool]) -> None:
        """Replace ``lm_head`` (after LoRA: peft froze the base, and the new head trains beside the
        adapters, never wrapped by peft). ``fused_impl`` does not apply: no vocabulary."""
        install_value_head(model, self.init_std, self.seed, self.path)

    @staticmethod
    def forward(model, flat: FlatBatch, modes: EngineConfig, sp, return_entropy: bool) -> Outputs:
        """``(values, None)``, ``values`` flat ``(total,)`` (``return_entropy`` has nothing to ask for)."""
        if sp is not None:
            return sp_forward_values(model, flat, use_remove_padding=modes.use_remove_padding, sp=sp), None
        return forward_values(model, flat, use_remove_padding=modes.use_remove_padding), None

    @staticmethod
    def fuses_loss(loss_fn, modes: EngineConfig, sp) -> bool:
        return False

    @staticmethod
    def loss_outputs(first: torch.Tensor, second: torch.Tensor | None) -> dict:
        """A critic's forward gives values where a policy's gives log-probs."""
        return {"log_probs": None, "entropy": second, "values": first}

    @staticmethod
    def log_prob_names(calculate_entropy: bool) -> tuple[str, ...]:
        raise ValueError("infer_batch: this engine is a critic (ModelConfig.value_head=True); use infer_values")

    @staticmethod
    def value_names() -> tuple[str, ...]:
        """What ``infer_values`` returns."""
        return ("values",)

    @staticmethod
    def score_names() -> tuple[str, ...]:
        raise ValueError("infer_scores: this engine is a critic (ModelConfig.value_head=True); use infer_values")

    @staticmethod
    def export_value_head(model, path, rank: int) -> None:
        """The head's ``weight``/``bias`` as safetensors from ``rank`` 0 (collective)."""
        export_value_head(model, path, rank)


class ScoreHead:
    """A reward model's head (engines/head/score.py): one score per sequence, at its last token;
    infer-only here (no loss reads it), no vocabulary, no sequence parallelism."""

    forward_method = SCORE_HEAD_METHOD

    def __init__(self, seed: int, path: str | None = None):
        self.seed, self.path = seed, path

    def install(self, model: torch.nn.Module, fused_impl: tuple[str, bool]) -> None:
        install_score_head(model, self.seed, self.path)

    @staticmethod
    def forward(model, flat: FlatBatch, modes: EngineConfig, sp, return_entropy: bool) -> Outputs:
        """``(scores, None)``: flat ``(total,)``, each sequence's score at its last position, 0 elsewhere."""
        if sp is not None:
            raise ValueError("ModelConfig.score_head: a reward model runs without sequence parallelism "
                             "(EngineConfig.ulysses_sp_size=1)")
        return forward_scores(model, flat, use_remove_padding=modes.use_remove_padding), None

    @staticmethod
    def fuses_loss(loss_fn, modes: EngineConfig, sp) -> bool:
        return False

    @staticmethod
    def loss_outputs(first: torch.Tensor, second: torch.Tensor | None) -> dict:
        raise ValueError("ModelConfig.score_head: a reward model is infer-only here (infer_scores); no loss reads it")

    @staticmethod
    def log_prob_names(calculate_entropy: bool) -> tuple[str, ...]:
        raise ValueError("infer_batch: this engine is a reward model (ModelConfig.score_head=True); use infer_scores")

    @staticmethod
    def value_names() -> tuple[str, ...]:
        raise ValueError("infer_values: this engine is a reward model (ModelConfig.score_head=True); use "
                         "infer_scores")

    @staticmethod
    def score_names() -> tuple[str, ...]:
        """What ``infer_scores`` runs (per token, summed per row by the engine)."""
        return ("scores",)

    @staticmethod
    def export_value_head(model, path, rank: int) -> None:
        raise ValueError("export_value_head: this engine is a reward model, not a critic")


def head_for(model_config: ModelConfig) -> LMHead | ValueHead | ScoreHead:
    """The head ``model_config`` asks for: a score head (``score_head=True``), a value head
    (``value_head=True``) or the LM head."""
    if model_config.score_head:
        return ScoreHead(model_config.seed, model_config.value_head_path)
    if model_config.value_head:
        return ValueHead(model_config.value_head_init_std, model_config.seed, model_config.value_head_path)
    return LMHead()
