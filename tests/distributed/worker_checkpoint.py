"""Worker: 2-rank FSDP2 save -> continue -> load into a different model -> continue again.

Each rank checks that params, its optimizer shard, the scheduler and its own RNG streams
come back exactly and that training continues identically; rank 0 also writes the sharded
model's logits next to an export_hf output for the parent test to compare.
"""
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

from polyfsdp.backends import destroy_distributed, get_backend, init_distributed
from polyfsdp.engines import checkpoint as ckpt

VOCAB = 64
out_dir = Path(sys.argv[1])
backend = get_backend()
mesh = init_distributed(backend)
rank = dist.get_rank()


def build(seed):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train(model, opt, sched, steps):
    losses = []
    for step in steps:
        x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def params(model):
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def local_optim(opt):
    return {(pid, k): (v.to_local() if hasattr(v, "to_local") else v).clone()
            for pid, st in opt.state_dict()["state"].items() for k, v in st.items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def draws():
    return torch.rand(2).tolist(), random.random(), float(np.random.rand())


model, opt, sched = build(seed=0)
torch.manual_seed(10 + rank)  # per-rank streams, so a mix-up of ranks' RNG files shows
random.seed(10 + rank)
np.random.seed(10 + rank)
train(model, opt, sched, range(2))
saved_params, saved_optim = params(model), local_optim(opt)
ckpt.save_checkpoint(out_dir / "ckpt", 2, model=model, optimizer=opt, lr_scheduler=sched, backend=backend,
                     extra={"samples_seen": 32})
after_save = draws()
if rank == 0:
    torch.save(saved_params, out_dir / "saved_params.pt")
continued = train(model, opt, sched, [2])
final = params(model)

x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
with torch.no_grad():
    logits = model(x, use_cache=False).logits
ckpt.export_hf(out_dir / "hf", model=model)
if rank == 0:
    torch.save({"input_ids": x, "logits": logits}, out_dir / "logits.pt")

other, other_opt, other_sched = build(seed=1)
step, extra = ckpt.load_checkpoint(out_dir / "ckpt", model=other, optimizer=other_opt,
                                   lr_scheduler=other_sched, backend=backend)
checks = {
    "step_extra": (step, extra) == (2, {"samples_seen": 32}),
    "params": same(params(other), saved_params),
    "optim_shard": same(local_optim(other_opt), saved_optim),
    "rng": draws() == after_save,
    "continue": train(other, other_opt, other_sched, [2]) == continued,
    "final": same(params(other), final),
}
# A file per rank: the two ranks' stdout lines can interleave.
(out_dir / f"result_rank{rank}.txt").write_text(" ".join(f"{k}={v}" for k, v in checks.items()))
destroy_distributed()
