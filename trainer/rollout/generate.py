"""Sampling completions from the FSDP policy (our decoding loop, or Hugging Face ``generate``
when ranks must decode in lockstep): what the ``PolicyDecoding`` rollout engine runs
(trainer/rollout/engines.py)."""
from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from polyfsdp.backends.distributed import all_reduce_sum, current_world_size

from ..config.rollout_check import check_unshard
from .engines import Completions, SamplingParams

logger = logging.getLogger(__name__)


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


def _hf_generate(model, ids, mask, params: SamplingParams, synced: bool, row_seeds: list[int] | None = None,
                 images: list | None = None):
    """HF ``generate``'s completions (and log-probs), cut as :func:`generate` documents. The
    distribution comes from our processor (trainer/rollout/row_sampler.py: the controls of
    trainer/rollout/controls/logits_shaping.py) whenever a control beyond the temperature is set or rows
    have seeds; with ``row_seeds``, greedy ``generate`` whose processor samples each row with
    its own generator, keeping the log-probs it drew from. With the default controls and no
    seeds, ``generate``'s own sampling at the temperature."""
    from transformers import GenerationConfig, LogitsProcessorList

    from .decode import prompt_tokens_seen
    from .decode import generate_image_inputs, placeholder_tokens
    from .controls.logits_shaping import penalized
    from .row_sampler import shaping_processor

    width, pad, stops = ids.shape[1], params.pad_token_id, list(params.stop_token_ids)
    do_sample, return_log_probs = not params.greedy, params.return_log_probs
    seeded = do_sample and row_seeds is not None
    shaped = seeded or penalized(params) or (do_sample and (params.top_k > 0 or params.top_p < 1.0))
    chooser = None
    if shaped:
        seen = (lambda vocab: prompt_tokens_seen(ids, mask, vocab)) if penalized(params) else None
        chooser = shaping_processor(params, seen, width, return_log_probs, row_seeds if seeded else None,
                                    ids.device)
        # Seeded, the chooser leaves one finite logit per row: greedy takes it. Else generate
        # samples the processed logits as they are (their temperature is already applied).
        do_sample = do_sample and not seeded
    temperature = 1.0 if shaped else params.temperature
    scores_out = return_log_probs and not seeded
    config = GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=do_sample, pad_token_id=pad,
                              eos_token_id=stops if len(stops) > 1 else stops[0], use_cache=True,
                              return_dict_in_generate=scores_out, output_scores=scores_out,
                              suppress_tokens=placeholder_tokens(model) or None,
                              **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if do_sample else {}))
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, synced_gpus=synced,
                         logits_processor=LogitsProcessorList([chooser] if chooser is not None else []),
                         **generate_image_inputs(model, ids, images))
    token_log_probs = None
    if scores_out:
        steps = torch.stack(out.scores, dim=1).float()  # (B, new tokens, vocab)
        out = out.sequences
        token_log_probs = torch.log_softmax(steps, -1).gather(-1, out[:, width:, None])[..., 0].tolist()
    elif return_log_probs:
        token_log_probs = torch.stack(chooser.log_probs, dim=1).tolist()
    completions = []
    for row in out[:, width:].tolist():
        ends = [row.index(s) for s in stops if s in row]
        if ends:
            row = row[: min(ends) + 1]
        else:
            # Finished rows are padded while others continue; eos == pad is handled above.
            while row and row[-1] == pad:
                row.pop()
        completions.append(row)
    if return_log_probs:
        return completions, [lp[:len(row)] for lp, row in zip(token_log_probs, completions)]
    return completions


@torch.no_grad()
def generate(engine, prompts: list[list[int]], params: SamplingParams, unshard="auto", loop: str = "auto",
             row_seeds: list[int] | None = None, images: list | None = None) -> Completions:
    """Completions (ending at and including a stop token when produced, or after a stop string)
    of ``prompts``, left-padded with ``params.pad_token_id``; with ``params.return_log_probs``,
    also each completion token's log-prob under the distribution it was drawn from
    (trainer/rollout/controls/logits_shaping.py: logits / temperature with the default controls, as
    ``generate``'s processed scores).

    Gathered once (``unshard``, see :func:`use_gather_once`) or on one rank, our decoding
    loop runs (trainer/rollout/decode.py: finished rows leave the batch) and each rank stops when its
    own rows are done. Otherwise, with several ranks, HF ``generate(synced_gpus=True)`` keeps
    every rank calling forward until all are done, as FSDP's per-layer all-gathers require.
    ``loop`` (``rollout.engine``) forces one of them: ``builtin`` or ``hf``. ``row_seeds`` (one
    per prompt, trainer/rollout/row_seeds.py): each row samples with its own generator, on either path.
    ``images`` (one per prompt: its Example with ``pixel_values``/``image_grid_thw``, or None): a
    vision-language policy's pixel inputs, on either path (trainer/rollout/decode.py).
    """
    from .decode import decode
    from .controls.stop_strings import cut_completions

    if not params.stop_token_ids or params.pad_token_id is None:
        raise ValueError(f"decoding with the policy needs a stop token and a pad token: got stop_token_ids="
                         f"{params.stop_token_ids!r}, pad_token_id={params.pad_token_id!r}")
    ids, mask = _left_padded(prompts, params.pad_token_id)
    device = engine.device
    once = use_gather_once(engine, unshard)
    ids, mask = ids.to(device), mask.to(device)
    with engine.eval_mode(), (engine.gathered() if once else nullcontext()):
        own_loop = decode_loop_ok(once) if loop == "auto" else loop == "builtin"
        if own_loop and not decode_loop_ok(once):
            raise ValueError("rollout.engine=builtin: on several ranks our decoding loop needs the model gathered "
                             "once, and rollout.unshard decided against it; set rollout.engine=hf or auto")
        if own_loop:
            out = decode(engine.module, ids, mask, params, row_seeds, images)
        else:
            # HF generate stops on stop tokens only: stop strings cut its completions after.
            out = _hf_generate(engine.module, ids, mask, params, synced=current_world_size() > 1 and not once,
                               row_seeds=row_seeds, images=images)
            tokens, log_probs = out if params.return_log_probs else (out, None)
            tokens, log_probs = cut_completions(tokens, log_probs, params)
            out = (tokens, log_probs) if params.return_log_probs else tokens
    return Completions(*out) if params.return_log_probs else Completions(out)
