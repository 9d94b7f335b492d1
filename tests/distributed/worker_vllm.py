"""torchrun worker: rollout.engine=vllm (one vLLM engine per rank) or, with arguments
``vllm_server COUNT``, rollout.engine=vllm_server (COUNT servers rank 0 starts, every rank
samples from, rank 0 pushes the gathered weights to) on a sharded FSDP2 policy.
Each rank compares the engine's greedy completions with our decoding loop's before and after an
optimizer step (the sync gathers every shard on all ranks; check_sync at 1e-5 stops a stale
one) and saves what it saw as rank<R>.pt."""
import os
import sys

from tests.helpers.vllm_cases import write_checkpoint  # noqa: E402

import torch  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.backends.distributed import barrier, init_distributed  # noqa: E402
from polyfsdp.backends.registry import get_backend  # noqa: E402
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig, SFTLoss  # noqa: E402
from polyfsdp.trainer.data.batch import build_batch  # noqa: E402
from polyfsdp.trainer.config.sections import RolloutSection  # noqa: E402
from polyfsdp.trainer.rollout.build import build_rollout_engine  # noqa: E402
from polyfsdp.trainer.rollout.engines import PolicyDecoding, SamplingParams  # noqa: E402
from polyfsdp.trainer.data.tokenizers import CharTokenizer  # noqa: E402


def main(out_dir, engine="vllm", count="1"):
    rank = int(os.environ["RANK"])
    init_distributed(get_backend())
    tok = CharTokenizer()
    path = os.path.join(out_dir, "model")
    if rank == 0:
        write_checkpoint(path, "qwen2-tiny", tok, seed=3)
    barrier()
    policy = FSDPEngine(ModelConfig(path=path), EngineConfig(), OptimConfig(lr=1e-2)).initialize()
    prompts = [[tok.bos_token_id] + tok.encode(s) for s in (("abc=", "ba=") if rank == 0 else ("hgfe=", "a="))]
    builtin = PolicyDecoding("builtin")
    section = RolloutSection(engine=engine, check_sync_tol=1e-5, server={"count": int(count)},
                             vllm={"kv_cache_mb": 64})
    vllm = build_rollout_engine(section, get_backend(), log_dir=os.path.join(out_dir, "server_logs"))
    greedy = SamplingParams.for_tokenizer(tok, 8, greedy=True)
    seen = {"sharded": any(type(p).__name__ == "DTensor" for p in policy.module.parameters())}
    try:
        for stage in ("before", "after"):
            vllm.update_weights(policy)  # the weight-sync phase: starts vLLM, then follows the step
            builtin.update_weights(policy)
            seen[stage] = (vllm.generate(prompts, greedy).token_ids, builtin.generate(prompts, greedy).token_ids)
            if stage == "before":
                pairs = [(p, [tok.encode("x")[0]] * 3) for p in prompts]
                policy.train_batch(build_batch(pairs, "no_padding", tok.pad_token_id), SFTLoss())
        seen.update(weight_version=vllm.weight_version, sync_error=vllm.last_sync_error)
    finally:
        vllm.close()
    torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
