"""torchrun worker: token-balanced data-parallel batches. Each rank brings a skewed batch
(rank 0 long sequences, the others short); an engine with balance_dp_tokens and one without
run infer_batch and one forward_backward on it. Rank 0 saves every rank's results."""
import os
import sys

import torch

from tests.helpers.engine_cases import PRESET, engine_config, masks_for, train_loss  # noqa: E402
from tests.helpers.engine_reference import left_right_batch, no_padding_batch, sequences  # noqa: E402

from rank_results import full_grads, save_every_rank  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402

SKEWED = {0: [12, 9, 7, 11], 1: [2, 1, 3]}


def main(out_dir, sp_size):
    rank = int(os.environ["RANK"])
    replica = rank // sp_size
    seqs = sequences(SKEWED[min(replica, 1)], seed=10 + replica)
    masks = masks_for(seqs)
    temps = torch.linspace(0.7, 1.3, len(seqs)) + replica
    results = {}
    for pad_mode, rmpad in (("no_padding", True), ("left_right", False)):
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        for balanced in (False, True):
            engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5),
                                engine_config(use_remove_padding=rmpad, pad_mode=pad_mode, ulysses_sp_size=sp_size,
                                              balance_dp_tokens=balanced)).initialize()
            key = f"{pad_mode}_{'balanced' if balanced else 'plain'}"
            out = engine.infer_batch(build(seqs), temperature=temps)
            results[f"infer_{key}"] = {k: (v.values() if v.is_nested else v) for k, v in out.items()}
            engine.forward_backward(build(seqs, per_token={"response_mask": masks}), train_loss())
            results[f"grads_{key}"] = full_grads(engine.module)
            results[f"metrics_{key}"] = engine.optimizer_step()
    save_every_rank(results, os.path.join(out_dir, "balance.pt"))
    print(f"rank={rank} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
