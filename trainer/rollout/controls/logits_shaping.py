"""The sampling distribution of one decoding step: repetition penalty, temperature, top-k and
top-p, as vLLM (0.32, ``vllm/v1/sample``) and Hugging Face ``generate`` define them; both
define them alike, in this order:

1. repetition penalty (``!= 1``), on the raw float32 logits of every token that occurs in the
   row's prompt or completion so far: a positive logit is divided by it, any other multiplied
   (HF's ``RepetitionPenaltyLogitsProcessor``; vLLM's ``apply_repetition_penalties``, which
   tests ``logit > 0`` where HF tests ``< 0``: the same at 0, where both give 0);
2. greedy decoding takes the argmax here (vLLM's processed log-probs of a greedy step are
   those of this distribution);
3. ``/ temperature``;
4. top-k (``> 0``): every logit below the k-th largest becomes -inf (ties with it stay);
5. top-p (``< 1``): sorted ascending, the tokens whose cumulative probability is ``<= 1 - p``
   become -inf, the most likely one always stays.

Tokens are drawn from, and their log-probs taken under, the softmax of the result: the
distribution each token was actually drawn from. With the defaults (no penalty, k 0, p 1)
this is ``logits / temperature``, the very operations of the sampler before these controls.
"""
from __future__ import annotations

import torch


def penalized(params) -> bool:
    """Whether ``params`` asks for a repetition penalty (the sampler then tracks seen tokens)."""
    return params.repetition_penalty != 1.0


def seen_tokens(prompts: list[list[int]], vocab: int, device) -> torch.Tensor:
    """(B, vocab) bool: which tokens each prompt holds (pad positions are no prompt tokens)."""
    seen = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        seen[row, torch.tensor(prompt, dtype=torch.long, device=device)] = True
    return seen


def shape_logits(logits: torch.Tensor, params, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The (B, vocab) float32 logits whose softmax is the step's sampling distribution (greedy:
    whose argmax is the token); ``seen``: (B, vocab) bool of the rows' prompt and completion
    tokens, needed with a repetition penalty."""
    logits = logits.float()
    if penalized(params):
        penalty = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    if params.greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ascending, order = torch.sort(logits, dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1.0 - params.top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits
