"""A reward model's score head (``ModelConfig(score_head=True)``): one scalar per sequence, the
output of the model's ``hidden -> 1`` score layer at the sequence's last token.

That is Hugging Face's sequence-classification convention (``*ForSequenceClassification`` with
``num_labels=1`` pools its logits at the last token), computed here on packed or padded rows
like every other forward. The score layer is the checkpoint's ``score`` (a
``*ForSequenceClassification``), or a value head loaded from ``value_head_path`` in ``lm_head``'s
place on a causal LM (engines/head/value.py: the format ``export_value_head`` writes).

Layout: per token, like the other heads (so micro-batches, placeholders, DP balance and the
caller's pad modes are the engine's usual path): the score sits at each sequence's last position
and every other position is 0, so a row's sum is its score (``FSDPEngine.infer_scores``).
"""
from __future__ import annotations

import types

import torch

from ..batch.flat import FlatBatch
from .forward import row_inputs
from .value import install_value_head

SCORE_HEAD_METHOD = "polyfsdp_score_head"


def score_layer_name(model, value_head_path: str | None) -> str:
    """Which of ``model``'s layers scores: ``lm_head`` when a value head is loaded from
    ``value_head_path``, else the sequence-classification ``score`` layer."""
    if value_head_path is not None:
        return "lm_head"
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise ValueError(f"ModelConfig.score_head: {type(model).__name__} has no 'score' linear layer; a reward "
                         f"model is a *ForSequenceClassification checkpoint, or a causal LM with value_head_path")
    return "score"


def install_score_head(model, seed: int, value_head_path: str | None = None) -> None:
    """Check the score layer gives one number (num_labels=1) and attach the score forward as a
    method of this instance (registered as an FSDP forward, so the root's parameters, the score
    layer's among them, are gathered while it runs)."""
    if value_head_path is not None:
        install_value_head(model, 0.0, seed, value_head_path)
    name = score_layer_name(model, value_head_path)
    outputs = getattr(model, name).out_features
    if outputs != 1:
        raise ValueError(f"ModelConfig.score_head: {type(model).__name__}.{name} gives {outputs} numbers per "
                         f"sequence (num_labels={outputs}); a reward model needs num_labels=1")
    setattr(model, SCORE_HEAD_METHOD, types.MethodType(lambda self, inputs, to_flat, last:
                                                       _score_head(self, inputs, to_flat, last, name), model))


def _score_head(self, model_inputs: dict, to_flat, last: torch.Tensor, name: str) -> torch.Tensor:
    """Decoder body -> the hidden states of each sequence's last token ``(B, hidden)`` -> the
    score layer ``(B, 1)``."""
    hidden = self.model(**model_inputs, use_cache=False).last_hidden_state
    return getattr(self, name)(to_flat(hidden)[last])


def forward_scores(model, flat: FlatBatch, *, use_remove_padding: bool) -> torch.Tensor:
    """Flat ``(total,)`` float32: each sequence's score at its last position, 0 elsewhere
    (empty sequences have none)."""
    out = torch.zeros(flat.total, dtype=torch.float32, device=flat.input_ids.device)
    if flat.total == 0:
        return out
    layout = row_inputs(use_remove_padding, model)
    # The host lengths pick the sequences that have a last token (no device read).
    nonempty = torch.tensor([i for i, n in enumerate(flat.seq_lens) if n], dtype=torch.long, device=out.device)
    last = (flat.offsets[1:] - 1)[nonempty]
    scores = getattr(model, SCORE_HEAD_METHOD)(layout.model_inputs(flat), lambda h: layout.to_flat(h, flat), last)
    out[last] = scores[:, 0].float()
    return out
