"""torchrun worker: engine.offload=optimizer at world size 2 through the CPU stand-in declared as an
accelerator (so the host step really runs), beside offload=none; a checkpoint after step 2 is
loaded into a fresh offload=optimizer engine that takes step 3 again. Rank 0 saves the results."""
import os
import sys

from tests.helpers.backend_standins import HostMemoryAccelerator  # noqa: E402
from tests.helpers.engine_cases import LENGTHS, PRESET, engine_config, masks_for, optim_config, rank_share  # noqa: E402
from tests.helpers.engine_reference import full_state_dict, no_padding_batch, sequences  # noqa: E402

import torch  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.engines.losses import SFTLoss  # noqa: E402

STEPS = 3


def engine(offload, seed=5):
    return FSDPEngine(ModelConfig(preset=PRESET, seed=seed), engine_config(offload=offload), optim_config(),
                      backend=HostMemoryAccelerator()).initialize()


def batch(step, rank, world):
    seqs = sequences(LENGTHS, seed=80 + step)
    mine = rank_share(len(seqs), rank, world, "alternate")
    masks = masks_for(seqs)
    return no_padding_batch([seqs[i] for i in mine], per_token={"response_mask": [masks[i] for i in mine]})


def main(out_dir):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for offload in ("none", "optimizer"):
        trained = engine(offload)
        results["initial"] = full_state_dict(trained.module)
        results[f"{offload}_metrics"] = []
        for step in range(STEPS):
            if step == STEPS - 1 and offload == "optimizer":
                trained.save_checkpoint(os.path.join(out_dir, "ckpt"))
            results[f"{offload}_metrics"].append(trained.train_batch(batch(step, rank, world), SFTLoss()))
        results[f"{offload}_params"] = full_state_dict(trained.module)
        results[f"{offload}_optimizer"] = type(trained.optimizer).__name__
    results["state_is_local_host_shard"] = all(
        v.to_local().device.type == "cpu" and v.to_local().shape == p.to_local().shape
        for p, s in trained.optimizer.state.items() for k, v in s.items() if k != "step")
    resumed = engine("optimizer", seed=9)
    results["resumed_step"] = resumed.load_checkpoint(os.path.join(out_dir, "ckpt"))[0]
    resumed.train_batch(batch(STEPS - 1, rank, world), SFTLoss())
    results["resumed_params"] = full_state_dict(resumed.module)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "world2.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
