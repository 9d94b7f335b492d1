"""torchrun worker: a reward model sharded over the ranks. Each rank scores its own rows (rank 0
more and longer ones, so under the token budget the ranks plan different numbers of forwards) in
both pad modes, then through RewardModelSource with rank 1 holding no row at all (it runs a
stand-in forward so rank 0's collectives pair up). Rank 0 saves every rank's scores."""
import os
import sys
from types import SimpleNamespace

import torch

from tests.helpers.engine_reference import left_right_batch, no_padding_batch, sequences  # noqa: E402

from rank_results import save_every_rank  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.trainer.data.example import Example  # noqa: E402
from polyfsdp.trainer.data.tokenizers import CharTokenizer  # noqa: E402
from polyfsdp.trainer.rewards.reward_model import RewardModelSource  # noqa: E402

ROWS = {0: [9, 4, 12, 7, 3], 1: [2, 5]}


def main(out_dir, path):
    rank = int(os.environ["RANK"])
    seqs = sequences(ROWS[rank], vocab=60, seed=30 + rank)
    results = {"seqs": seqs}
    for pad_mode, rmpad in (("no_padding", True), ("left_right", False)):
        engine = FSDPEngine(ModelConfig(path=path, score_head=True),
                            EngineConfig(use_remove_padding=rmpad, pad_mode=pad_mode,
                                         max_tokens_per_micro_batch=10)).initialize()
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        results[pad_mode] = engine.infer_scores(build(seqs))
    section = SimpleNamespace(name="model", weight=1.0, data_sources=None, path=path, template="auto")
    tok = CharTokenizer()
    source = RewardModelSource(section, engine, tok, tok, "left_right")
    mine = [Example("abc=", "cba", prompt_ids=(1, 7, 8, 9))] if rank == 0 else []
    results["source"] = source.score_all(mine, ["x"] * len(mine), [[10, 11]] * len(mine))[0]
    save_every_rank(results, os.path.join(out_dir, "scores.pt"))
    print(f"rank={rank} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
