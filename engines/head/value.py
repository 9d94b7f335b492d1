"""The critic's scalar value head: the causal LM's body with ``lm_head`` replaced by a
``hidden -> 1`` linear layer (``ModelConfig(value_head=True)``), and the forward that turns
a FlatBatch into one value per token.

Position convention (the log-prob convention, docs/architecture.md): ``values[i][t]`` is the
value of the state ``x[i][:t+1]``, i.e. the state before token ``t + 1`` is generated, so it
lines up with ``log_probs[i][t]`` and ``response_mask[i][t]``; the last position of every
sequence is 0 (no next token, no state to value).

The head is installed in ``lm_head``'s place so FSDP2 shards and gathers it with the root,
like the LM head it replaces, and checkpoints save it under ``lm_head.*``.
"""
from __future__ import annotations

import os
import types

import torch

from ..batch.flat import FlatBatch
from .forward import row_inputs
from ..jagged.labels import IGNORE_INDEX, next_token_labels_flat

VALUE_HEAD_METHOD = "polyfsdp_value_head"


VALUE_HEAD_KEYS = ("weight", "bias")


def install_value_head(model, init_std: float, seed: int, path: str | None = None) -> None:
    """Replace ``model.lm_head`` by a ``hidden -> 1`` linear layer with bias: weight
    ``N(0, init_std)`` (seeded, so every rank builds the same head), bias 0, or the head
    saved at ``path``; and attach the value forward as a method of this instance
    (registered as an FSDP forward method)."""
    old = model.get_output_embeddings()
    if not isinstance(old, torch.nn.Linear):
        raise ValueError(f"ModelConfig.value_head: {type(model).__name__}'s output layer is not a plain nn.Linear")
    head = torch.nn.Linear(old.in_features, 1, bias=True, dtype=old.weight.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.nn.init.normal_(head.weight, std=init_std)
    torch.nn.init.zeros_(head.bias)
    if path is not None:
        with torch.no_grad():
            for name, tensor in load_value_head(path, old.in_features).items():
                getattr(head, name).copy_(tensor)
    # A tied LM head shares the embedding matrix; the value head must not.
    model.config.tie_word_embeddings = False
    model.lm_head = head
    setattr(model, VALUE_HEAD_METHOD, types.MethodType(_value_head, model))


def _value_head(self, model_inputs: dict, to_flat) -> torch.Tensor:
    """Decoder body -> hidden states of the real tokens ``(total, hidden)`` -> head ``(total, 1)``.
    Called through the root so FSDP2 gathers the embeddings, final norm and head; the
    caller takes column 0 (an FSDP forward should not return a view)."""
    hidden = self.model(**model_inputs, use_cache=False).last_hidden_state
    return self.lm_head(to_flat(hidden))


def forward_values(model, flat: FlatBatch, *, use_remove_padding: bool) -> torch.Tensor:
    """Per-token values of ``flat`` (flat ``(total,)``, float32, last position of each
    sequence 0), with autograd when enabled; packed or padded rows as for log-probs."""
    if flat.total == 0:
        return flat.input_ids.new_zeros(0, dtype=torch.float32)
    layout = row_inputs(use_remove_padding, model)
    values = getattr(model, VALUE_HEAD_METHOD)(layout.model_inputs(flat), lambda h: layout.to_flat(h, flat))[:, 0]
    has_next = next_token_labels_flat(flat.input_ids, flat.offsets, fill=IGNORE_INDEX) != IGNORE_INDEX
    return torch.where(has_next, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))


def load_value_head(path: str | os.PathLike, hidden_size: int) -> dict[str, torch.Tensor]:
    """A saved value head's ``{weight (1, hidden), bias (1,)}``; one-line errors for a missing,
    unreadable or mismatched file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"ModelConfig.value_head_path: no such file: {path}")
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"ModelConfig.value_head_path: {path} is not a readable safetensors file ({exc})") from None
    want = {"weight": (1, hidden_size), "bias": (1,)}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != want:
        raise ValueError(f"ModelConfig.value_head_path: {path} holds {got}; a value head for this model "
                         f"needs {want}")
    return state


def export_value_head(model, path: str | os.PathLike, rank: int) -> None:
    """Collective over the model's ranks: gather the head's ``weight``/``bias`` (DTensors when
    sharded) and have ``rank`` 0 write them as safetensors, the format ``value_head_path`` reads."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    head = model.get_output_embeddings()
    state = {}
    for name in VALUE_HEAD_KEYS:
        tensor = getattr(head, name).detach()
        state[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu().contiguous()
    if rank == 0:
        save_file(state, str(path))
