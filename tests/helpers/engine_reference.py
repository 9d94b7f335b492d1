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


# Peaked outputs for precision tests. The random presets are near-uniform (entropy 4.844-4.848
# vs ln 128 = 4.852), so a constant-entropy or wrong-temperature bug hides inside any bf16
# tolerance. Scaling the final norm's weight by 4 scales every logit by 4: entropies spread
# to 2.3-4.83 (temperatures 0.5-2.0) and a 10% temperature error moves log-probs by >= 0.23.
SHARPEN_FACTOR = 4.0
SHARP_LENGTHS = [6, 1, 12, 6, 6, 3]
SHARP_TEMPS = [1.0, 0.7, 1.3, 0.5, 2.0, 0.9]
# bf16 compute vs the fp32 reference on the sharpened presets (seed 3, SHARP_LENGTHS with seed 11,
# SHARP_TEMPS), worst over the remove-padding x fused modes, measured on CPU (torch 2.13):
#   qwen2-tiny       log-probs 5.7e-3  entropy 1.5e-3
#   qwen2-tiny-tied  log-probs 1.2e-2  entropy 9.7e-3
#   llama-tiny       log-probs 6.6e-3  entropy 7.6e-4
# Tolerances are 3x those (rounded up): bf16 error grows with the logit scale, so the tied preset
# (the most peaked, entropies down to 2.3) needs the widest. The wrong-temperature control sits
# 20-65x above them (log-probs 0.23-0.55, entropy 0.11-0.64).
BF16_TOLERANCE = {"qwen2-tiny": {"log_probs": 1.8e-2, "entropy": 5e-3},
                  "qwen2-tiny-tied": {"log_probs": 3.6e-2, "entropy": 3e-2},
                  "llama-tiny": {"log_probs": 2e-2, "entropy": 2.5e-3}}


def sharpen_outputs(module, factor=SHARPEN_FACTOR):
    """Scale the final norm's weight of an (FSDP2) causal LM in place, so logits grow by ``factor``."""
    with torch.no_grad():
        module.model.norm.weight.mul_(factor)


def sharp_reference(preset, module, seqs, temperatures, device="cpu"):
    """fp32 reference log-probs and entropy (flat float64 on the CPU) of ``module``'s weights at
    ``temperatures``, and the same at 0.9 x temperatures (the negative control)."""
    reference = reference_model(preset, {k: v.cpu() for k, v in full_state_dict(module).items()}).to(device)
    seqs = [s.to(device) for s in seqs]
    out = {}
    with torch.no_grad():
        for name, temps in (("right", temperatures), ("wrong", [0.9 * t for t in temperatures])):
            lps, ents = reference_logprobs(reference, seqs, temps)
            out[name] = {"log_probs": torch.cat(lps).cpu(), "entropy": torch.cat(ents).cpu()}
    return out


def assert_matches_and_rejects_wrong_temperature(got, reference, key, tol, label=""):
    """``got`` (flat) is within ``tol`` of the reference, and NOT within it of the 0.9 x T reference
    (so the tolerance could catch an ignored or wrong temperature). For entropy, no constant
    (e.g. ln(vocab)) could pass either: the reference's spread must exceed twice the tolerance."""
    got = got.detach().double().cpu()
    diff = (got - reference["right"][key]).abs().max().item()
    assert diff <= tol, f"{label} {key}: max |diff| {diff:.3g} > tol {tol:.3g}"
    wrong = (got - reference["wrong"][key]).abs().max().item()
    assert wrong > tol, f"{label} {key}: a 0.9 x temperature reference is within tol ({wrong:.3g} <= {tol:.3g})"
    if key == "entropy":
        real = reference["right"][key][reference["right"][key] != 0]
        spread = (real.max() - real.min()).item()
        assert spread > 2 * tol, f"{label} entropy spread {spread:.3g} <= 2 x tol: a constant would pass"


def built_once_per_key(build):
    """A module-scoped fixture's body: yields ``get(key)``, which builds ``build(key)`` (an engine
    and its reference outputs, say) the first time a key is asked for and reuses it after."""
    built = {}

    def get(key):
        if key not in built:
            built[key] = build(key)
        return built[key]

    yield get
    built.clear()
