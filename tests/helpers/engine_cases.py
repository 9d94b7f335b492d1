"""Shared engine test cases (batch, loss, config), used by CPU and distributed tests."""
import torch

from tests.helpers.engine_reference import prompt_lengths
from polyfsdp.engines.config import EngineConfig, OptimConfig
from polyfsdp.engines.losses import SFTLoss

PRESET = "qwen2-tiny-tied"
LENGTHS = [6, 1, 12, 6, 6, 3, 9, 4]
LR = 1e-3


# World-size-2 cases: (name, remove_padding, fused, pad_mode, token budget, how ranks split
# the batch). "uneven" gives rank 1 only the length-1 sequence, so under a budget it runs
# placeholder micro-batches to match rank 0's count.
DIST_CASES = (
    ("rmpad_fused_nopad", True, True, "no_padding", None, "alternate"),
    ("padded_unfused_lr", False, False, "left_right", None, "alternate"),
    ("rmpad_unfused_budget", True, False, "no_padding", 12, "alternate"),
    ("padded_fused_uneven", False, True, "no_padding", 12, "uneven"),
)


def rank_share(num_seqs, rank, world, how):
    """The sequence indices rank ``rank`` trains on."""
    if how == "alternate":
        return list(range(rank, num_seqs, world))
    if how == "uneven":
        return [1] if rank == world - 1 else [i for i in range(num_seqs) if i != 1]
    raise ValueError(f"unknown split {how!r}")


def engine_config(**overrides):
    """The engine config of the engine tests (modes from ``overrides``)."""
    return EngineConfig(**overrides)


def optim_config():
    """The optimizer of the engine tests (AdamW, lr 1e-3, wd 0.01, clip 1.0)."""
    return OptimConfig(lr=LR, weight_decay=0.01, grad_clip=1.0)


def masks_for(seqs):
    """Response masks aligned with log_probs (position t counts when x[t+1] is a response token)."""
    out = []
    for s, p in zip(seqs, prompt_lengths(seqs)):
        m = torch.zeros(len(s))
        m[max(p - 1, 0): len(s) - 1] = 1.0
        out.append(m)
    return out


def train_loss():
    """The loss of the training tests: token-mean SFT NLL over the response."""
    return SFTLoss()


def reference_sft_step(initial_state, seqs, masks):
    """One SFT step on the plain HF model holding ``initial_state``: token-mean NLL over the
    masks (per sequence, alone), clip to norm 1.0, torch AdamW. Returns
    (params after, clipped grads, loss, grad norm)."""
    from tests.helpers.engine_reference import reference_logprobs, reference_model

    model = reference_model(PRESET, initial_state).train()
    lps, _ = reference_logprobs(model, seqs, [1.0] * len(seqs))
    count = sum(m.sum() for m in masks)
    loss = -sum(lp.dot(m.double()) for lp, m in zip(lps, masks)) / count
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    grads.setdefault("lm_head.weight", grads["model.embed_tokens.weight"])
    torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01).step()
    after = {k: v.detach().clone() for k, v in model.state_dict().items() if k in initial_state}
    return after, grads, float(loss.detach()), float(norm)
