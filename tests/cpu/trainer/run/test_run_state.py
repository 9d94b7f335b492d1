"""A phase's checkpoint as named parts (trainer/run/state.py): the policy, the critic and the
trainer position are saved and restored by one mechanism, in a fixed order, and a checkpoint
in the layout main's job wrote (the position as a plain ``extra`` dict, the critic as part
``critic``) resumes every part unchanged."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.checkpoint_cases import VOCAB, build_sharded, full_params, train_steps

from polyfsdp.backends import get_backend, init_distributed
from polyfsdp.engines.checkpoint import CheckpointError, CheckpointMixin, latest_checkpoint
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.run.resume import ResumePoint
from polyfsdp.trainer.run.state import PhaseState, TrainerPosition

# The extra dict main's Job._checkpoint wrote, key for key and in its order.
MAINS_EXTRA = {"phase": "rl", "phase_step": 2, "global_step": 7, "world_size": 1, "metrics_lines": 11,
               "metrics_path": "/run/metrics.jsonl", "data_position": 8, "eval_due": False}


@pytest.fixture(scope="module")
def mesh():
    return init_distributed(get_backend("cpu"))


class _Engine(CheckpointMixin):
    """The checkpoint side of an engine, over a tiny sharded model."""

    def __init__(self, mesh, seed: int) -> None:
        self.module, self.optimizer, self.lr_scheduler = build_sharded(mesh, seed)
        self.backend, self.global_step, self.model_config = None, 0, None

    def train(self, steps: int, seed: int) -> None:
        def batch(step):
            return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed + step))
        train_steps(self.module, self.optimizer, self.lr_scheduler, range(steps), batch)


def test_the_position_is_saved_as_the_extra_mains_job_wrote():
    position = TrainerPosition(**MAINS_EXTRA)
    assert list(position.state_dict().items()) == list(MAINS_EXTRA.items())
    assert TrainerPosition.from_state_dict(position.state_dict()) == position


def test_a_position_of_older_code_without_world_size_loads_and_one_without_its_step_is_refused():
    older = {k: v for k, v in MAINS_EXTRA.items() if k != "world_size"}
    assert TrainerPosition.from_state_dict(older).world_size is None
    # Saved before a checkpoint could precede its step's evaluation: none is due.
    assert TrainerPosition.from_state_dict({k: v for k, v in MAINS_EXTRA.items() if k != "eval_due"}).eval_due is False
    with pytest.raises(CheckpointError, match="phase_step"):
        TrainerPosition.from_state_dict({k: v for k, v in MAINS_EXTRA.items() if k != "phase_step"})


def test_the_parts_are_registered_in_a_fixed_order(mesh):
    policy, critic = _Engine(mesh, 1), _Engine(mesh, 2)
    assert PhaseState(policy, critic).names() == ["policy", "critic", "trainer"]
    assert PhaseState(policy).names() == ["policy", "trainer"]
    assert PhaseState(policy, critic).models() == {"critic": critic}


def test_a_checkpoint_in_mains_layout_restores_every_part(mesh, tmp_path):
    policy, critic = _Engine(mesh, 1), _Engine(mesh, 2)
    policy.train(2, seed=10)
    critic.train(3, seed=20)
    # Saved as main's job did: the critic a part of the policy's checkpoint, the position its extra.
    policy.save_checkpoint(str(tmp_path / "checkpoints" / "rl"), step=2, extra=dict(MAINS_EXTRA),
                           parts={"critic": critic})
    checkpoint = latest_checkpoint(tmp_path / "checkpoints" / "rl")

    fresh_policy, fresh_critic = _Engine(mesh, 3), _Engine(mesh, 4)
    state = PhaseState(fresh_policy, fresh_critic)
    loaded, position = state.load(ResumePoint("rl", checkpoint, tmp_path), say=print)
    assert loaded == checkpoint and position == TrainerPosition(**MAINS_EXTRA) and state.position == position
    for restored, trained in ((fresh_policy, policy), (fresh_critic, critic)):
        assert restored.global_step == 2
        for name, value in full_params(trained.module).items():
            assert torch.equal(full_params(restored.module)[name], value), name
        assert restored.lr_scheduler.state_dict() == trained.lr_scheduler.state_dict()


def test_save_then_load_round_trips_every_part(mesh, tmp_path):
    policy, critic = _Engine(mesh, 1), _Engine(mesh, 2)
    policy.train(1, seed=30)
    critic.train(2, seed=40)
    position = TrainerPosition("rl", 1, 4, 1, 5, str(tmp_path / "metrics.jsonl"), data_position=4)
    saved = PhaseState(policy, critic).save(tmp_path / "rl", position, keep=None, background=False)
    fresh_policy, fresh_critic = _Engine(mesh, 5), _Engine(mesh, 6)
    _, loaded = PhaseState(fresh_policy, fresh_critic).load(ResumePoint("rl", saved, tmp_path), say=print)
    assert loaded == position
    for restored, trained in ((fresh_policy, policy), (fresh_critic, critic)):
        for name, value in full_params(trained.module).items():
            assert torch.equal(full_params(restored.module)[name], value), name


def test_a_checkpoint_without_a_trainer_position_is_one_config_error(mesh, tmp_path):
    policy = _Engine(mesh, 1)
    path = policy.save_checkpoint(str(tmp_path / "rl"), step=1)  # an engine checkpoint, not a job's
    with pytest.raises(ConfigError, match="trainer state lacks"):
        PhaseState(_Engine(mesh, 2)).load(ResumePoint("rl", path, tmp_path), say=print)
