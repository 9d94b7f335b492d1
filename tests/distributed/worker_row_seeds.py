"""torchrun worker (or a plain process for one rank): one RL step's sampled completions.

``OUT``: the same policy (qwen2-tiny, seeded) and the same global prompts; each replica samples
its contiguous share with ``algo.actor.group_size`` completions per prompt, seeded as the
trainer seeds them (trainer/run/job.py: ``RowSeeds`` from trainer.seed, the step and the share's
first global prompt), with the default rollout engine and with HF ``generate`` (per-layer
gathers, ranks in lockstep), and, as the negative control, with the per-replica seed polyfsdp
used before (one generator per replica). Rank 0 saves every engine's completions, in global
row order, to ``completions_world{W}.pt``."""
import os
import sys
from pathlib import Path

import torch

from polyfsdp.backends import current_world_size, destroy_distributed, get_backend, init_distributed  # noqa: E402
from polyfsdp.backends.distributed import all_gather_object  # noqa: E402
from polyfsdp.backends.topology import topology  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.trainer.config.algo import ActorSection  # noqa: E402
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver  # noqa: E402
from polyfsdp.trainer.rollout.engines import PolicyDecoding  # noqa: E402
from polyfsdp.trainer.rollout.row_seeds import RowSeeds  # noqa: E402
from polyfsdp.trainer.rollout.sampling import GroupSampling, sample_groups  # noqa: E402
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.example import Example  # noqa: E402

SEED, STEP, PROMPTS = 3, 5, 8


def main(out: Path) -> None:
    tok = CharTokenizer()
    policy = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=2, vocab_size=tok.vocab_size),
                        EngineConfig()).initialize()
    topo = topology()
    examples = [Example(prompt=f"{'abcdefgh'[:i + 1]}=", answer="a") for i in range(PROMPTS)]
    share = topo.replica_share(examples, "examples")
    actor = ActorSection(group_size=4, max_new_tokens=8, temperature=1.0)
    row_seeds = RowSeeds(SEED, STEP, first_prompt=topo.share_start(PROMPTS))
    results = {}
    for name, engine, seeds in (("default", PolicyDecoding(), row_seeds),
                                ("hf", PolicyDecoding("hf", unshard=False), row_seeds),
                                ("per_replica", PolicyDecoding(), None)):
        engine.update_weights(policy)
        # The old formula seeded each replica's one generator: (seed * 1_000_003 + step) * 1024 + replica.
        policy.backend.manual_seed((SEED * 1_000_003 + STEP) * 1024 + topo.replica)
        rows = sample_groups(policy, tok, share, GroupSampling.of(tok, actor, False), SingleTurnDriver(engine),
                             row_seeds=seeds).kept.response_ids
        results[name] = [row for part in all_gather_object(rows) for row in part]
    if topo.rank == 0:
        torch.save(results, out / f"completions_world{current_world_size()}.pt")
    destroy_distributed()


if __name__ == "__main__":
    init_distributed(get_backend())
    main(Path(sys.argv[1]))
