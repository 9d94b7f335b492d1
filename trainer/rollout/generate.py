"""Sampling completions from the FSDP policy (our decoding loop, or Hugging Face ``generate``
when ranks must decode in lockstep), and scoring completions from any rollout engine
(trainer/rollout/engines.py)."""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from polyfsdp.backends.distributed import all_reduce_sum, current_world_size

from ..data.chat import example_prompt_tokens
from ..rank_errors import on_every_rank
from .engines import check_unshard
from ..data.example import Example

logger = logging.getLogger(__name__)


@dataclass
class Rollout:
    """Completions of a list of prompts: token lists, decoded text and rewards."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    rewards: list[float]
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)
    # The sampler's log-prob of each response token (at the sampling temperature), when asked.
    log_probs: list[list[float]] | None = None
    # Each completion's answer for majority votes (rewards.Scorer.score_with_answer), when asked.
    answers: list[str | None] | None = None
    # Multi-turn (trainer/rollout/multi_turn.py): 1 for the response tokens the policy sampled, 0 for the
    # environment's; None: every response token was sampled.
    loss_masks: list[list[int]] | None = None
    # Per-trajectory values of the rollout itself (multi-turn: turns, tool calls, truncations).
    rollout_metrics: dict[str, list[float]] = field(default_factory=dict)

    def pairs(self) -> list[tuple]:
        """(prompt, response) per row, with the row's loss mask as a third item when there is one
        (what trainer/data/batch.py builds batches from)."""
        if self.loss_masks is None:
            return list(zip(self.prompt_ids, self.response_ids))
        return list(zip(self.prompt_ids, self.response_ids, self.loss_masks))


def use_gather_once(engine, unshard) -> bool:
    """``rollout.unshard``: True gathers the model once per rollout, False gathers each layer
    at every decoding step (least memory), ``auto`` gathers once when the full model fits.
    Every rank must decide alike (synced decoding pairs collectives), so ``auto`` agrees
    over ranks."""
    check_unshard(unshard)
    if unshard != "auto":
        return bool(unshard)
    fits = engine.gather_fits()
    if current_world_size() == 1:
        return fits
    return all_reduce_sum([0.0 if fits else 1.0], engine.device)[0] == 0.0


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` of left-padded prompts, built without a per-row tensor."""
    width = max(len(p) for p in prompts)
    flat = [pad] * (width * len(prompts))
    mask = [0] * (width * len(prompts))
    for i, p in enumerate(prompts):
        start = i * width + width - len(p)
        flat[start:start + len(p)] = p
        mask[start:start + len(p)] = [1] * len(p)
    shape = (len(prompts), width)
    return torch.tensor(flat, dtype=torch.long).view(shape), torch.tensor(mask, dtype=torch.long).view(shape)


def decode_loop_ok(gather_once: bool) -> bool:
    """Whether rollouts use our own decoding loop (trainer/rollout/decode.py): whenever no rank has to
    keep calling forward for the others, i.e. one rank or the model gathered once. With
    per-layer gathers on several ranks, HF ``generate(synced_gpus=True)`` keeps ranks paired."""
    return gather_once or current_world_size() == 1


def _hf_generate(model, ids, mask, width, pad, eos, max_new_tokens, do_sample, temperature, return_log_probs,
                 synced: bool, row_seeds: list[int] | None = None):
    """HF ``generate``'s completions (and log-probs), cut as :func:`generate` documents; with
    ``row_seeds``, greedy ``generate`` whose logits processor samples each row with its own
    generator (trainer/rollout/row_sampler.py), keeping the log-probs it drew from."""
    from transformers import GenerationConfig, LogitsProcessorList

    from .row_sampler import row_seeded_processor

    chooser = None
    if do_sample and row_seeds is not None:
        chooser = row_seeded_processor(row_seeds, ids.device, temperature, return_log_probs)
        do_sample = False  # the chooser leaves one finite logit per row: greedy takes it
    scores_out = return_log_probs and chooser is None
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad,
                              eos_token_id=eos, use_cache=True,
                              return_dict_in_generate=scores_out, output_scores=scores_out,
                              **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if do_sample else {}))
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, synced_gpus=synced,
                         logits_processor=LogitsProcessorList([chooser] if chooser is not None else []))
    token_log_probs = None
    if scores_out:
        steps = torch.stack(out.scores, dim=1).float()  # (B, new tokens, vocab)
        out = out.sequences
        token_log_probs = torch.log_softmax(steps, -1).gather(-1, out[:, width:, None])[..., 0].tolist()
    elif return_log_probs:
        token_log_probs = torch.stack(chooser.log_probs, dim=1).tolist()
    completions = []
    for row in out[:, width:].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        else:
            # Finished rows are padded while others continue; eos == pad is handled above.
            while row and row[-1] == pad:
                row.pop()
        completions.append(row)
    if return_log_probs:
        return completions, [lp[:len(row)] for lp, row in zip(token_log_probs, completions)]
    return completions


@torch.no_grad()
def generate(engine, tokenizer, prompts: list[list[int]], max_new_tokens: int, do_sample: bool,
             temperature: float = 1.0, return_log_probs: bool = False, unshard="auto", loop: str = "auto",
             row_seeds: list[int] | None = None):
    """Completions (ending at and including ``<eos>`` when produced) for left-padded prompts;
    with ``return_log_probs``, also each completion token's log-prob under the distribution
    it was drawn from (logits / temperature, as ``generate``'s processed scores).

    Gathered once (``unshard``, see :func:`use_gather_once`) or on one rank, our decoding
    loop runs (trainer/rollout/decode.py: finished rows leave the batch) and each rank stops when its
    own rows are done. Otherwise, with several ranks, HF ``generate(synced_gpus=True)`` keeps
    every rank calling forward until all are done, as FSDP's per-layer all-gathers require.
    ``loop`` (``rollout.engine``) forces one of them: ``builtin`` or ``hf``. ``row_seeds`` (one
    per prompt, trainer/rollout/row_seeds.py): each row samples with its own generator, on either path.
    """
    from .decode import decode

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids, mask = _left_padded(prompts, pad)
    device = engine.device
    once = use_gather_once(engine, unshard)
    ids, mask = ids.to(device), mask.to(device)
    with engine.eval_mode(), (engine.gathered() if once else nullcontext()):
        own_loop = decode_loop_ok(once) if loop == "auto" else loop == "builtin"
        if own_loop and not decode_loop_ok(once):
            raise ValueError("rollout.engine=builtin: on several ranks our decoding loop needs the model gathered "
                             "once, and rollout.unshard decided against it; set rollout.engine=hf or auto")
        if own_loop:
            return decode(engine.module, ids, mask, max_new_tokens, eos, do_sample, temperature, return_log_probs,
                          row_seeds)
        return _hf_generate(engine.module, ids, mask, ids.shape[1], pad, eos, max_new_tokens, do_sample,
                            temperature, return_log_probs, synced=current_world_size() > 1 and not once,
                            row_seeds=row_seeds)


def _default_scorer():
    from ..rewards.reward_fn import Scorer, load_reward_fn

    return Scorer(load_reward_fn("char_match"), "char_match")


def rollout(engine, tokenizer, examples: list[Example], n: int, max_new_tokens: int, do_sample: bool,
            temperature: float = 1.0, scorer=None, return_log_probs: bool = False, sampler=None,
            with_answers: bool = False, row_seeds: list[int] | None = None) -> Rollout:
    """``n`` completions per example (grouped: example i owns rows i*n .. i*n+n-1), scored
    by ``scorer`` (a rewards.Scorer; default the built-in ``char_match``); ``sampler`` is the
    rollout engine (trainer/rollout/engines.py; default ``auto``); ``row_seeds``: one sampling
    seed per row (trainer/rollout/row_seeds.py), else the process's generator draws."""
    from .engines import PolicyDecoding

    if getattr(sampler, "multi_turn", False):
        return sampler.rollout(engine, tokenizer, examples, n, max_new_tokens, do_sample, temperature, scorer,
                               return_log_probs, with_answers, row_seeds=row_seeds)
    prompts = [example_prompt_tokens(tokenizer, ex) for ex in examples for _ in range(n)]
    responses = (sampler or PolicyDecoding()).generate(engine, tokenizer, prompts, max_new_tokens, do_sample,
                                                       temperature, return_log_probs, row_seeds=row_seeds)
    log_probs = None
    if return_log_probs:
        responses, log_probs = responses
    texts = [tokenizer.decode(r) for r in responses]
    # A reward that raises on this rank's records must stop every rank (the next step is a collective).
    answers = [] if with_answers else None
    rewards, extras = on_every_rank(lambda: (scorer or _default_scorer()).score_all(examples, texts, responses,
                                                                                     group=n, answers=answers))
    return Rollout(prompts, responses, texts, rewards, extras, log_probs, answers)
