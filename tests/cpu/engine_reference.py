"""Independent references and batch builders for the engine tests (plain HF, per sequence)."""
from __future__ import annotations

import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from polyfsdp.engines.presets import preset_config


def sequences(lengths, vocab=128, seed=0):
    """Random token sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def jagged_of(parts, dtype=None):
    """A jagged nested tensor of per-sequence tensors, built with torch directly."""
    lengths = torch.tensor([len(p) for p in parts])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    values = torch.cat(parts) if dtype is None else torch.cat(parts).to(dtype)
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=int(lengths.min()),
                                                  max_seqlen=int(lengths.max()))


def no_padding_batch(seqs, per_token=None, per_seq=None):
    """TensorDict in the no_padding layout; per_token: name -> list of per-sequence tensors."""
    data = {"input_ids": jagged_of(seqs)}
    for name, parts in (per_token or {}).items():
        data[name] = jagged_of(parts)
    data.update(per_seq or {})
    return TensorDict(data, batch_size=[len(seqs)])


def prompt_lengths(seqs):
    """A prompt/response split per sequence: about a third of each sequence is prompt."""
    return [max(1, len(s) // 3) if len(s) else 0 for s in seqs]


def left_right_dense(parts, prompts, fill=0):
    """Place per-sequence tensors into the left_right layout: prompt left-padded, response
    right-padded. Returns (dense (B, L), attention_mask (B, L))."""
    max_p = max(prompts)
    max_r = max(len(s) - p for s, p in zip(parts, prompts))
    dense = torch.full((len(parts), max_p + max_r), fill, dtype=parts[0].dtype)
    mask = torch.zeros((len(parts), max_p + max_r), dtype=torch.long)
    for i, (s, p) in enumerate(zip(parts, prompts)):
        dense[i, max_p - p: max_p - p + len(s)] = s
        mask[i, max_p - p: max_p - p + len(s)] = 1
    return dense, mask


def left_right_batch(seqs, per_token=None, per_seq=None):
    """TensorDict in the left_right layout."""
    prompts = prompt_lengths(seqs)
    ids, mask = left_right_dense(seqs, prompts)
    data = {"input_ids": ids, "attention_mask": mask}
    for name, parts in (per_token or {}).items():
        data[name] = left_right_dense(parts, prompts)[0]
    data.update(per_seq or {})
    return TensorDict(data, batch_size=[len(seqs)])


def per_sequence(values, batch, pad_mode):
    """Split a per-token engine output (jagged, or dense aligned with ``input_ids``) into
    one flat tensor per sequence."""
    if pad_mode == "no_padding":
        return [t for t in values.unbind()]
    mask = batch["attention_mask"].bool()
    return [values[i][mask[i]] for i in range(values.shape[0])]


def full_state_dict(module):
    """Unsharded copies of every parameter/buffer of an FSDP2 module."""
    out = {}
    for name, value in module.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = value.detach().clone()
    return out


def reference_model(preset, state_dict):
    """Plain, unsharded HF model (eager attention) holding ``state_dict``."""
    model = AutoModelForCausalLM.from_config(preset_config(preset), attn_implementation="eager")
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # Tied heads appear once in the state dict; nothing else may be absent.
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model.eval()


def reference_logprobs(model, seqs, temperatures):
    """Per sequence, alone: log_softmax(logits / T) at the next token and the entropy,
    last position 0 (docs/architecture.md convention). Returns lists of float64 tensors."""
    lps, ents = [], []
    for s, t in zip(seqs, temperatures):
        if len(s) == 0:
            lps.append(torch.zeros(0, dtype=torch.float64))
            ents.append(torch.zeros(0, dtype=torch.float64))
            continue
        logits = model(input_ids=s[None], use_cache=False).logits[0].double() / float(t)
        logp = torch.log_softmax(logits, -1)
        lp = torch.zeros(len(s), dtype=torch.float64, device=s.device)
        ent = torch.zeros(len(s), dtype=torch.float64, device=s.device)
        if len(s) > 1:
            lp[:-1] = logp[:-1].gather(-1, s[1:, None])[:, 0]
            ent[:-1] = -(logp[:-1].exp() * logp[:-1]).sum(-1)
        lps.append(lp)
        ents.append(ent)
    return lps, ents


ADAM_EPS = 1e-8


def adam_first_step_tolerance(grad, lr, grad_tol, floor=1e-7):
    """Per-element bound on how far a first AdamW step may move when the gradient it saw is
    off by ``grad_tol``: the update is lr * g / (|g| + eps), whose slope in g is
    lr * eps / (|g| + eps)^2 (bounded by the update's range, 2 * lr). Large gradients give
    a tight bound; gradients near zero (e.g. key biases, analytically zero) give a loose one."""
    slope = lr * ADAM_EPS / (grad.abs() + ADAM_EPS) ** 2
    return floor + torch.clamp(slope * grad_tol, max=2 * lr)


def assert_params_close_after_adam_step(actual, expected, grads, lr, grad_tol):
    """Every parameter within :func:`adam_first_step_tolerance` of the reference step."""
    for name, value in expected.items():
        grad = grads[name]
        tol = adam_first_step_tolerance(grad, lr, grad_tol)
        diff = (actual[name] - value).abs()
        worst = int((diff - tol).argmax())
        assert bool((diff <= tol).all()), (
            f"{name}: |diff| {diff.flatten()[worst].item():.3g} > tol {tol.flatten()[worst].item():.3g} "
            f"(grad {grad.flatten()[worst].item():.3g})")
