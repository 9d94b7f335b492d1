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

from tests.helpers.checkpoint_cases import VOCAB, build_sharded, full_params, train_steps  # noqa: E402

from polyfsdp.backends import destroy_distributed, get_backend, init_distributed  # noqa: E402
from polyfsdp.engines import checkpoint as ckpt  # noqa: E402

out_dir = Path(sys.argv[1])
backend = get_backend()
mesh = init_distributed(backend)
rank = dist.get_rank()


def build(seed):
    return build_sharded(mesh, seed)


def batch(step):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def train(model, opt, sched, steps):
    return train_steps(model, opt, sched, steps, batch)


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
saved_params, saved_optim = full_params(model), local_optim(opt)
ckpt.save_checkpoint(out_dir / "ckpt", 2, model=model, optimizer=opt, lr_scheduler=sched, backend=backend,
                     extra={"samples_seen": 32})
after_save = draws()
if rank == 0:
    torch.save(saved_params, out_dir / "saved_params.pt")
continued = train(model, opt, sched, [2])
final = full_params(model)

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
    "params": same(full_params(other), saved_params),
    "optim_shard": same(local_optim(other_opt), saved_optim),
    "rng": draws() == after_save,
    "continue": train(other, other_opt, other_sched, [2]) == continued,
    "final": same(full_params(other), final),
}
# A file per rank: the two ranks' stdout lines can interleave.
(out_dir / f"result_rank{rank}.txt").write_text(" ".join(f"{k}={v}" for k, v in checks.items()))
destroy_distributed()
