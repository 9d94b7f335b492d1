"""Calls of torch_npu ops whose batch-dependent limits (backends/npu_limits.py) a model's config
cannot rule out, split into calls inside them. The engine decides batch sizes at run time: a
packed micro-batch may hold more sequences than one TND call takes, a padded one more rows than
the rotary op takes. Sequences (and rows) are independent, so the split gives the same numbers.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from .npu_limits import FA_TOKENS, FA_VARLEN_SEQUENCES, ROPE_BATCH_HEADS_BELOW


def _tnd_groups(q_ends: list[int], kv_ends: list[int]) -> list[tuple[int, int, int, int]]:
    """(first, last+1) sequence indices plus their q and kv token starts, each group within the
    per-call limits (at most FA_VARLEN_SEQUENCES sequences and FA_TOKENS tokens of q and of kv)."""
    groups, first, q_start, kv_start = [], 0, 0, 0
    for index, (q_end, kv_end) in enumerate(zip(q_ends, kv_ends)):
        too_many = index - first == FA_VARLEN_SEQUENCES
        too_long = q_end - q_start > FA_TOKENS[1] or kv_end - kv_start > FA_TOKENS[1]
        if index > first and (too_many or too_long):
            groups.append((first, index, q_start, kv_start))
            first, q_start, kv_start = index, q_ends[index - 1], kv_ends[index - 1]
    groups.append((first, len(q_ends), q_start, kv_start))
    return groups


def split_fusion_attention(op: Callable) -> Callable:
    """``npu_fusion_attention`` that runs a TND call (``actual_seq_qlen``/``actual_seq_kvlen`` as
    keywords) with too many sequences or tokens as several calls on consecutive sequences. A split
    call returns ``(attention_out,)``: the softmax statistics of separate calls are not one tensor."""

    @functools.wraps(op)
    def call(query, key, value, head_num, input_layout, *args, actual_seq_qlen=None, actual_seq_kvlen=None,
             **kwargs):
        if input_layout != "TND" or actual_seq_qlen is None or actual_seq_kvlen is None:
            return op(query, key, value, head_num, input_layout, *args, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_kvlen=actual_seq_kvlen, **kwargs)
        q_ends, kv_ends = list(actual_seq_qlen), list(actual_seq_kvlen)
        groups = _tnd_groups(q_ends, kv_ends)
        if len(groups) == 1 or len(q_ends) != len(kv_ends):
            return op(query, key, value, head_num, input_layout, *args, actual_seq_qlen=q_ends,
                      actual_seq_kvlen=kv_ends, **kwargs)
        outs = []
        for first, last, q_start, kv_start in groups:
            q_end, kv_end = q_ends[last - 1], kv_ends[last - 1]
            outs.append(op(query[q_start:q_end], key[kv_start:kv_end], value[kv_start:kv_end], head_num,
                           input_layout, *args, actual_seq_qlen=[e - q_start for e in q_ends[first:last]],
                           actual_seq_kvlen=[e - kv_start for e in kv_ends[first:last]], **kwargs)[0])
        return (torch.cat(outs),)

    return call


def split_rotary_mul(op: Callable) -> Callable:
    """``npu_rotary_mul`` that runs a 4-D input with ``ROPE_BATCH_HEADS_BELOW`` or more rows (dim 0)
    as several calls on consecutive rows (r1/r2 sliced alike when they have a row each)."""
    step = ROPE_BATCH_HEADS_BELOW - 1

    @functools.wraps(op)
    def call(x, r1, r2, *args, **kwargs):
        rows = x.shape[0]
        if x.dim() != 4 or rows <= step:
            return op(x, r1, r2, *args, **kwargs)

        def rows_of(r, start):
            return r[start:start + step] if r.shape[0] == rows else r

        return torch.cat([op(x[start:start + step], rows_of(r1, start), rows_of(r2, start), *args, **kwargs)
                          for start in range(0, rows, step)])

    return call


SPLITTERS = {"fusion_attention": split_fusion_attention, "rotary_mul": split_rotary_mul}
