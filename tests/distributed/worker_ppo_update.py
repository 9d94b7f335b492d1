"""torchrun worker: PPO's updates on one fixed rollout (trainer/algos/rl_step.py's train_on_rollout: old, ref and
critic values, GAE whitened over ranks, two epochs of critic and actor steps), each rank
holding its share of the groups. Rank 0 saves the metrics and the trained weights."""
import os
import sys
from types import SimpleNamespace

import torch

from tests.helpers.engine_reference import full_state_dict  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.trainer.config.job import load_config  # noqa: E402
from polyfsdp.trainer.rollout.drivers.result import Rollout  # noqa: E402
from polyfsdp.trainer.algos.rl_step import RLContext, train_on_rollout  # noqa: E402
from polyfsdp.trainer.rollout.engines import SamplingParams  # noqa: E402
from polyfsdp.trainer.rollout.sampling import GroupSampling  # noqa: E402

PROMPTS = 4
GROUP = 2
OVERRIDES = ["algo=ppo", f"algo.actor.group_size={GROUP}", "algo.actor.epochs=2", f"trainer.prompts_per_step={PROMPTS}",
             "algo.critic.gamma=0.95", "algo.critic.lam=0.9", "algo.critic.kl_in_reward=true", "algo.actor.kl_coef=0.1",
             "algo.critic.cliprange_value=0.2"]


def rollout():
    """Fixed prompts and completions (varied lengths, a length-1 response) and rewards."""
    g = torch.Generator().manual_seed(17)
    prompts, responses = [], []
    for i in range(PROMPTS * GROUP):
        prompts.append(torch.randint(1, 128, (2 + i % 3,), generator=g).tolist())
        responses.append(torch.randint(1, 128, (1 + (i * 5) % 7,), generator=g).tolist())
    rewards = torch.rand(PROMPTS * GROUP, generator=g).tolist()
    return Rollout(prompts, responses, [""] * len(prompts), rewards)


def main(out_dir):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    algo = load_config(OVERRIDES, world_size=world).algo
    engine = EngineConfig(pad_mode="left_right" if "left_right" in sys.argv else "no_padding")
    policy = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=5), engine, algo.actor.optim).initialize()
    ref = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=6), engine, algo.actor.optim).initialize()
    critic = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=5, value_head=True, value_head_init_std=0.3), engine,
                        algo.critic.optim).initialize()
    full = rollout()
    per = len(full.rewards) // world
    mine = slice(rank * per, (rank + 1) * per)
    roll = Rollout(full.prompt_ids[mine], full.response_ids[mine], full.texts[mine], full.rewards[mine])
    pairs = list(zip(roll.prompt_ids, roll.response_ids))
    # The rollout is made up: the sampling settings are never read.
    ctx = RLContext(policy, SimpleNamespace(pad_token_id=0), algo, algo.actor_loss(PROMPTS), ref=ref,
                    sampling=GroupSampling(SamplingParams(1), GROUP), critic=critic,
                    value_loss=algo.critic.value_loss())
    metrics, _ = train_on_rollout(ctx, roll, pairs, shuffle_seed=0, train_actor=True)
    results = {"metrics": metrics, "policy": full_state_dict(policy.module), "critic": full_state_dict(critic.module)}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"world{world}.pt"))
    print(f"rank={rank} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
