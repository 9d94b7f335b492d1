"""The critic's independent reference (tests/cpu/engines/head/test_value_head.py, the critic + LoRA and
critic + sequence-parallel tests): the plain HF decoder body's hidden states times the
head's weight plus bias, each sequence alone, last position 0; and verl's clipped value loss
with autograd on it."""
from __future__ import annotations

import torch
from transformers import AutoModel

from polyfsdp.engines.presets import preset_config


class CriticReference:
    """Body + head (unsharded, eager) from a critic's full state dict (plain HF keys)."""

    def __init__(self, preset: str, state: dict):
        self.head_w, self.head_b = state["lm_head.weight"].double(), state["lm_head.bias"].double()
        self.body = AutoModel.from_config(preset_config(preset), attn_implementation="eager").eval()
        body_state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        self.body.load_state_dict(body_state, strict=True)

    def reference_values(self, seqs):
        out = []
        for s in seqs:
            v = torch.zeros(len(s), dtype=torch.float64)
            if len(s) > 1:
                hidden = self.body(input_ids=s[None], use_cache=False).last_hidden_state[0].double()
                v[:-1] = (hidden @ self.head_w.T)[:-1, 0] + self.head_b[0]
            out.append(v)
        return out

    def value_loss_grads(self, seqs, masks, old, returns, clip):
        """(loss, gradients by the critic's parameter names) of the clipped value loss."""
        self.body.zero_grad(set_to_none=True)
        w = self.head_w.float().clone().requires_grad_(True)
        b = self.head_b.float().clone().requires_grad_(True)
        total, count = 0.0, sum(float(m.sum()) for m in masks)
        for s, m, o, r in zip(seqs, masks, old, returns):
            if len(s) < 2:
                continue
            hidden = self.body(input_ids=s[None], use_cache=False).last_hidden_state[0]
            v = torch.cat([(hidden @ w.T)[:-1, 0] + b[0], torch.zeros(1)])
            vclip = o + torch.clamp(v - o, -clip, clip)
            total = total + 0.5 * (torch.maximum((v - r) ** 2, (vclip - r) ** 2) * m).sum() / count
        total.backward()
        grads = {f"model.{n}": p.grad.detach().clone() for n, p in self.body.named_parameters()}
        grads["lm_head.weight"], grads["lm_head.bias"] = w.grad, b.grad
        self.body.zero_grad(set_to_none=True)
        return total.item(), grads
