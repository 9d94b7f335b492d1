"""torchrun worker (or a plain process for one rank): elastic resume of one checkpoint.

``save OUT``: a full fine-tune policy, a PPO critic (value head) and a LoRA policy train two
steps on this world's shares of fixed batches; they are saved as one checkpoint (the critic and
the LoRA engine as its parts). ``load OUT``: fresh engines (other weights, other adapters) load it
on this world size. Either way rank 0 saves every engine's full parameters and optimizer state
(``{save,load}_world{W}.pt``), and every rank what it hashed while loading and whether its RNG
was left alone. ``load`` then also loads a copy whose ``__0_0.distcp`` has one byte flipped and
records each rank's error line."""
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tests.helpers.engine_cases import masks_for, rank_share  # noqa: E402
from tests.helpers.engine_reference import no_padding_batch, sequences  # noqa: E402
from tests.helpers.lora_cases import lora_engine  # noqa: E402
from tests.helpers.lora_reference import randomize_adapters  # noqa: E402
from rank_results import save_every_rank  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: E402

from polyfsdp.backends import barrier, current_rank, current_world_size, destroy_distributed  # noqa: E402
from polyfsdp.engines.checkpoint import files as checkpoint_files  # noqa: E402
from polyfsdp.engines.checkpoint import CheckpointError  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.engines.losses import SFTLoss  # noqa: E402
from polyfsdp.engines.losses.value import ValueLoss  # noqa: E402

LENGTHS = [6, 2, 12, 6, 3, 9, 5, 7]
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01)


def engines(seed):
    policy = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=seed), EngineConfig(), OPTIM).initialize()
    critic = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=seed + 1, value_head=True, value_head_init_std=0.3),
                        EngineConfig(), OPTIM).initialize()
    lora = lora_engine(seed=3)  # the frozen base is rebuilt from its seed; only the adapters are saved
    randomize_adapters(lora.module, seed=seed)
    return {"policy": policy, "critic": critic, "lora": lora}


def batch(step, rank, world):
    seqs, keep = sequences(LENGTHS, seed=80 + step), rank_share(len(LENGTHS), rank, world, "alternate")
    masks = masks_for(seqs)
    g = torch.Generator().manual_seed(90 + step)
    returns = [torch.randn(len(s), generator=g) for s in seqs]
    per_token = {"response_mask": masks, "old_values": [torch.zeros(len(s)) for s in seqs], "returns": returns}
    return no_padding_batch([seqs[i] for i in keep], per_token={k: [v[i] for i in keep] for k, v in per_token.items()})


def full_state(engine):
    """The full parameters (trained ones) and the full optimizer state, on rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in engine.module.named_parameters() if p.requires_grad}
    return {"params": params, "optim": get_optimizer_state_dict(engine.module, engine.optimizer, options=options).get("state", {})}


def main(mode, out):
    rank, world = current_rank(), current_world_size()
    ckpt = out / "ckpt"
    built = engines(seed=5 if mode == "save" else 11)
    policy, parts = built["policy"], {"critic": built["critic"], "lora": built["lora"]}
    results = {}
    if mode == "save":
        for step in range(2):
            for name, engine in built.items():
                engine.train_batch(batch(step, rank, world), ValueLoss() if name == "critic" else SFTLoss())
        policy.save_checkpoint(str(ckpt), step=2, parts=parts)
    else:
        hashed = []
        real_sha256 = checkpoint_files._sha256
        checkpoint_files._sha256 = lambda path, *span: (hashed.append(Path(path).name), real_sha256(path, *span))[1]
        torch.manual_seed(1000 + rank)
        rng_before = torch.get_rng_state()
        step, _ = policy.load_checkpoint(str(ckpt), parts=parts)
        results.update(step=step, hashed=sorted(set(hashed)), rng_kept=torch.equal(torch.get_rng_state(), rng_before))
        damaged = out / f"damaged_world{world}"
        if rank == 0:
            shutil.copytree(ckpt / "step_000002", damaged / "step_000002")
            shard = damaged / "step_000002" / "__0_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        barrier()
        try:
            policy.load_checkpoint(str(damaged), parts=parts)
            results["damaged_error"] = None
        except CheckpointError as exc:
            results["damaged_error"] = f"{type(exc).__name__}: {exc}"
    states = {name: full_state(engine) for name, engine in built.items()}
    if rank == 0:
        torch.save(states, out / f"{mode}_world{world}.pt")
    if world > 1:
        save_every_rank(results, out / f"{mode}_ranks_world{world}.pt")
    else:
        torch.save([results], out / f"{mode}_ranks_world{world}.pt")
    destroy_distributed()


if __name__ == "__main__":
    from polyfsdp.backends import get_backend, init_distributed

    init_distributed(get_backend())
    main(sys.argv[1], Path(sys.argv[2]))
