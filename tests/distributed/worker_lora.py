"""torchrun worker: a LoRA engine (tests/distributed/test_lora_ranks.py's settings) at world size 2.
Every rank trains on its alternating share of each batch; after step 1 a checkpoint is saved.
Rank 0 saves the full trained parameters after each step, the metrics and the initial state."""
import os
import sys

from tests.helpers.engine_cases import rank_share  # noqa: E402
from tests.helpers.engine_reference import full_state_dict  # noqa: E402
from tests.helpers.lora_cases import STEPS, lora_engine, step_batch  # noqa: E402

import torch  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.engines.losses import SFTLoss  # noqa: E402


def main(out_dir):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    engine = lora_engine()
    results = {"initial": full_state_dict(engine.module), "metrics": [], "trained": []}
    for step in range(STEPS):
        mine = step_batch(step, share=lambda n: rank_share(n, rank, world, "alternate"))
        results["metrics"].append(engine.train_batch(mine, SFTLoss()))
        results["trained"].append({k: v for k, v in full_state_dict(engine.module).items() if ".lora_" in k})
        if step == 0:
            engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "world2.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
