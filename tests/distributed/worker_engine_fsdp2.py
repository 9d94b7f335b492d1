"""torchrun worker: FSDPEngine at world size 2 (on the backend POLYFSDP_BACKEND names) — infer_batch on the whole batch, then one
train_batch step with each rank holding its share of it. Rank 0 saves the results."""
import os
import sys

import torch

from tests.helpers.engine_cases import DIST_CASES, LENGTHS, PRESET, engine_config, optim_config, masks_for, rank_share, train_loss  # noqa: E402
from tests.helpers.engine_reference import full_state_dict, left_right_batch, no_padding_batch, sequences  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402


def main(out_dir):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    seqs = sequences(LENGTHS, seed=21)
    masks = masks_for(seqs)
    results = {}
    for name, rmpad, fused, pad_mode, budget, how in DIST_CASES:
        engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5),
                            engine_config(use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode,
                                          max_tokens_per_micro_batch=budget), optim_config()).initialize()
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        out = engine.infer_batch(build(seqs), temperature=torch.linspace(0.6, 1.4, len(seqs)))
        results[f"infer_{name}"] = {k: (v.values() if v.is_nested else v) for k, v in out.items()}
        mine = rank_share(len(seqs), rank, world, how)
        part = build([seqs[i] for i in mine], per_token={"response_mask": [masks[i] for i in mine]})
        results[f"train_metrics_{name}"] = engine.train_batch(part, train_loss())
        results[f"train_params_{name}"] = full_state_dict(engine.module)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "world2.pt"))
    print(f"rank={rank} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
