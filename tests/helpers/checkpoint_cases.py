"""The tiny FSDP2-sharded Qwen2, its optimizer and its training loop, shared by the
checkpoint tests at world size 1 (test_checkpoint) and 2 (distributed/worker_checkpoint)."""
import torch
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

VOCAB = 64


def tiny_config(tied=True):
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def build_sharded(mesh, seed, tied=True):
    """(model sharded per layer and at the root, AdamW, warm-up LambdaLR), weights from ``seed``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(tied))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train_steps(model, opt, sched, steps, batch):
    """One LM step per entry of ``steps`` on ``batch(step)``; returns the losses."""
    losses = []
    for step in steps:
        x = batch(step)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def full_params(model):
    """Unsharded copies of the parameters, by name."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
