"""Worker: init_distributed on the backend POLYFSDP_BACKEND names, one all-reduce on this rank's
device, report the mesh."""
import os
import sys

import torch
import torch.distributed as dist

from polyfsdp.backends import destroy_distributed, get_backend, init_distributed

backend = get_backend()
mesh = init_distributed(backend)
value = torch.tensor([float(dist.get_rank() + 1)], device=backend.device(int(os.environ["LOCAL_RANK"])))
dist.all_reduce(value)
# One write per line: torchrun runs workers with `python -u`, where print() writes the text
# and its newline separately, and the two ranks' lines interleaved ("...sum=3.0rank=1 ...").
sys.stdout.write(f"rank={dist.get_rank()} world={dist.get_world_size()} mesh={mesh.size()} "
                 f"backend={dist.get_backend()} device={value.device.type} sum={value.item()}\n")
sys.stdout.flush()
destroy_distributed()
