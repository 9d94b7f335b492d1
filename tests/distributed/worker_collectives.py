"""Worker: every collective helper on a two-rank group (the backend POLYFSDP_BACKEND names:
gloo, nccl or hccl); one report line per rank."""
import os
import sys

import torch

from polyfsdp.backends import (
    all_gather_object,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    destroy_distributed,
    get_backend,
    init_distributed,
)

backend = get_backend()
init_distributed(backend)
rank = torch.distributed.get_rank()
device = backend.device(int(os.environ["LOCAL_RANK"]))  # nccl/hccl reduce only this rank's device tensors
summed = all_reduce_sum([rank + 1.0, 10.0 * rank], device)
peak = all_reduce_max(torch.tensor([rank, 5 - rank], device=device))
gathered = all_gather_object(f"r{rank}")
chosen = broadcast_object(f"from{rank}", src=1)
barrier()
# One write per line: under torchrun's `python -u` the ranks' print() output interleaved.
sys.stdout.write(f"rank={rank} backend={torch.distributed.get_backend()} device={peak.device.type} "
                 f"sum={summed} max={peak.tolist()} gathered={gathered} broadcast={chosen}\n")
sys.stdout.flush()
destroy_distributed()
