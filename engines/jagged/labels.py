"""Next-token labels of a jagged batch: ``label[t] = x[t + 1]`` within each sequence."""
from __future__ import annotations

import torch

from . import checks
from .kernels import packed, to_device, wrap

IGNORE_INDEX = -100
"""Label given to the last position of every sequence (the fused op's ``ignore_index``)."""


def next_token_labels_flat(values: torch.Tensor, offsets: torch.Tensor, fill=IGNORE_INDEX) -> torch.Tensor:
    """Per sequence ``label[t] = x[t + 1]``; each sequence's last position gets ``fill``.

    Works on flat ``values (total, *rest)`` + ``offsets``; never reads across a sequence
    boundary and never synchronises (empty sequences are harmless).
    """
    checks.check_tensor(values, "values")
    checks.check_index_vector(offsets, "offsets")
    total = values.shape[0]
    labels = torch.empty_like(values)
    if total == 0:
        return labels
    labels[:-1] = values[1:]
    # An empty sequence's "last" index (offsets - 1) is the previous sequence's last
    # position, or -1 -> total - 1 (the final non-empty sequence's last): filled anyway.
    last = torch.remainder(offsets[1:].to(torch.int64) - 1, total)
    return labels.index_fill_(0, to_device(last, values.device), fill)


def next_token_labels(nt: torch.Tensor, pad_label=IGNORE_INDEX) -> torch.Tensor:
    """Jagged next-token labels of a jagged nested tensor (last position = ``pad_label``, default -100)."""
    checks.check_jagged(nt)
    values, offs = packed(nt)
    return wrap(next_token_labels_flat(values, offs, pad_label), offs, int(nt._min_seqlen), int(nt._max_seqlen))
