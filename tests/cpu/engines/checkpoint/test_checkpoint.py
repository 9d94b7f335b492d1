"""Sharded checkpoints (engines/checkpoint/) on a tiny FSDP2-wrapped Qwen2, world size 1."""
import random
import shutil

import numpy as np
import pytest
import torch
from tests.helpers.checkpoint_cases import VOCAB, build_sharded, full_params, train_steps
from transformers import AutoModelForCausalLM

from polyfsdp.backends import get_backend, init_distributed
from polyfsdp.engines import checkpoint as ckpt


@pytest.fixture(scope="module")
def mesh():
    return init_distributed(get_backend("cpu"))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (2, 8), generator=g)


def _train(model, opt, sched, steps):
    return train_steps(model, opt, sched, steps, _batch)


def _optim_state(opt):
    out = {}
    for pid, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[(pid, key)] = value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
    return out


def _rng_draws():
    return torch.rand(3), random.random(), np.random.rand()


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=str(key))


def test_round_trip_restores_params_optimizer_scheduler_rng_and_continues_identically(mesh, tmp_path):
    model, opt, sched = build_sharded(mesh, seed=0)
    _train(model, opt, sched, range(2))
    saved_params, saved_optim, saved_lr = full_params(model), _optim_state(opt), sched.get_last_lr()
    ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, lr_scheduler=sched,
                         backend=get_backend("cpu"), extra={"data_position": 7})
    draws_after_save = _rng_draws()
    continued = _train(model, opt, sched, [2])
    params_after_3 = full_params(model)

    other, other_opt, other_sched = build_sharded(mesh, seed=1)  # different initial weights
    _rng_draws()  # move the generators so that restoring them matters
    step, extra = ckpt.load_checkpoint(tmp_path, model=other, optimizer=other_opt,
                                       lr_scheduler=other_sched, backend=get_backend("cpu"))
    assert (step, extra) == (2, {"data_position": 7})
    _assert_same(full_params(other), saved_params)
    _assert_same(_optim_state(other_opt), saved_optim)
    assert other_sched.get_last_lr() == saved_lr and other_sched.last_epoch == 2
    restored = _rng_draws()
    torch.testing.assert_close(restored[0], draws_after_save[0], atol=0, rtol=0)
    assert restored[1:] == draws_after_save[1:]
    assert _train(other, other_opt, other_sched, [2]) == continued
    _assert_same(full_params(other), params_after_3)


def test_crash_during_save_leaves_previous_checkpoint_latest_and_loadable(mesh, tmp_path, monkeypatch):
    model, opt, sched = build_sharded(mesh, seed=0)
    _train(model, opt, sched, range(1))
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched)
    params_at_1 = full_params(model)
    _train(model, opt, sched, [1])

    real_save = ckpt.dcp.save

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)  # shards are on disk, the commit has not happened
        raise RuntimeError("injected crash")

    monkeypatch.setattr(ckpt.dcp, "save", save_then_crash)
    with pytest.raises(RuntimeError, match="injected crash"):
        ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, lr_scheduler=sched)
    monkeypatch.undo()

    assert (tmp_path / ".tmp-step_000002").is_dir()
    assert (tmp_path / "latest").read_text().strip() == "step_000001"
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    fresh, fresh_opt, fresh_sched = build_sharded(mesh, seed=3)
    step, _ = ckpt.load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched)
    assert step == 1
    _assert_same(full_params(fresh), params_at_1)

    # The next save clears the leftover and completes.
    ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, lr_scheduler=sched)
    assert not (tmp_path / ".tmp-step_000002").exists()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000002"


def test_crash_while_replacing_latest_keeps_old_pointer_intact(mesh, tmp_path, monkeypatch):
    model, opt, sched = build_sharded(mesh, seed=0)
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched)

    def crash(*args, **kwargs):
        raise OSError("injected crash in os.replace")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError, match="injected"):
        ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, lr_scheduler=sched)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "step_000001"
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000001"


def test_saving_before_the_first_step_does_not_perturb_training_and_restores_a_fresh_optimizer(mesh, tmp_path):
    model, opt, sched = build_sharded(mesh, seed=0)
    initial = full_params(model)
    ckpt.save_checkpoint(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched)
    assert not opt.state  # no optimizer state was created by the save
    losses = _train(model, opt, sched, range(2))
    unsaved, unsaved_opt, unsaved_sched = build_sharded(mesh, seed=0)
    assert _train(unsaved, unsaved_opt, unsaved_sched, range(2)) == losses
    _assert_same(full_params(unsaved), full_params(model))

    step, _ = ckpt.load_checkpoint(tmp_path, model=model, optimizer=opt, lr_scheduler=sched)
    assert step == 0 and not opt.state and sched.last_epoch == 0
    _assert_same(full_params(model), initial)
    assert _train(model, opt, sched, range(2)) == losses


def test_keep_k_retains_only_the_newest_k_checkpoints(mesh, tmp_path):
    model, opt, sched = build_sharded(mesh, seed=0)
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model=model, optimizer=opt, lr_scheduler=sched, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_000003", "step_000004"]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000004"
    # Re-saving an existing step replaces it; saving an older step never deletes the new save.
    ckpt.save_checkpoint(tmp_path, 4, model=model, optimizer=opt, lr_scheduler=sched, keep=2)
    ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, lr_scheduler=sched, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000002"


def test_latest_checkpoint_ignores_temporary_dirs_and_falls_back_without_pointer(mesh, tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    model, opt, sched = build_sharded(mesh, seed=0)
    ckpt.save_checkpoint(tmp_path, 5, model=model, optimizer=opt, lr_scheduler=sched)
    (tmp_path / ".tmp-step_000009").mkdir()
    (tmp_path / "step_000010").mkdir()  # no trainer_state.pt: not complete
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000005"
    (tmp_path / "latest").unlink()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000005"


def test_bad_arguments_and_missing_checkpoint_raise_clear_errors(mesh, tmp_path):
    model, opt, sched = build_sharded(mesh, seed=0)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.load_checkpoint(tmp_path, model=model, optimizer=opt, lr_scheduler=sched)
    with pytest.raises(ValueError, match="keep must be a positive int"):
        ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, keep=0)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        ckpt.save_checkpoint(tmp_path, -1, model=model, optimizer=opt)
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=None)
    with pytest.raises(ValueError, match="no scheduler state"):
        ckpt.load_checkpoint(tmp_path, model=model, optimizer=opt, lr_scheduler=sched)


def test_named_parts_are_saved_loaded_and_pruned_with_the_checkpoint(mesh, tmp_path):
    # A second model trained in the same run (PPO's critic) is a part of the same checkpoint.
    actor, actor_opt, actor_sched = build_sharded(mesh, seed=0)
    critic, critic_opt, critic_sched = build_sharded(mesh, seed=1, tied=False)
    _train(actor, actor_opt, actor_sched, range(2))
    _train(critic, critic_opt, critic_sched, range(3))
    critic_part = ckpt.CheckpointPart(critic, critic_opt, critic_sched)
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, model=actor, optimizer=actor_opt, lr_scheduler=actor_sched,
                             extra={"at": step}, keep=1, parts={"critic": critic_part})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]
    assert ckpt.checkpoint_parts(tmp_path / "step_000002") == ["critic"]

    new_actor, new_actor_opt, new_actor_sched = build_sharded(mesh, seed=5)
    new_critic, new_critic_opt, new_critic_sched = build_sharded(mesh, seed=6, tied=False)
    step, extra = ckpt.load_checkpoint(
        tmp_path, model=new_actor, optimizer=new_actor_opt, lr_scheduler=new_actor_sched,
        parts={"critic": ckpt.CheckpointPart(new_critic, new_critic_opt, new_critic_sched)})
    assert (step, extra) == (2, {"at": 2})
    _assert_same(full_params(new_actor), full_params(actor))
    _assert_same(_optim_state(new_actor_opt), _optim_state(actor_opt))
    _assert_same(full_params(new_critic), full_params(critic))
    _assert_same(_optim_state(new_critic_opt), _optim_state(critic_opt))
    assert new_actor_sched.last_epoch == 2 and new_critic_sched.last_epoch == 3

    # The main part alone still loads; a part the checkpoint lacks is one line naming it.
    other, other_opt, _ = build_sharded(mesh, seed=7)
    ckpt.load_checkpoint(tmp_path, model=other, optimizer=other_opt)
    _assert_same(full_params(other), full_params(actor))
    with pytest.raises(ckpt.CheckpointError, match=r"holds no part reward_model \(its parts: critic\)$"):
        ckpt.load_checkpoint(tmp_path, model=other, optimizer=other_opt,
                             parts={"reward_model": ckpt.CheckpointPart(new_critic)})


def test_a_deletion_cut_short_leaves_no_partial_checkpoint_and_the_next_save_cleans_it(mesh, tmp_path, monkeypatch):
    model, opt, sched = build_sharded(mesh, seed=0)
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, keep=1)

    def crash(path, *args, **kwargs):
        raise KeyboardInterrupt  # what a kill halfway through deleting step_000001 leaves

    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, keep=1)
    monkeypatch.undo()
    # The old checkpoint was renamed out of the step_* names before its deletion began.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-del-step_000001", "latest", "step_000002"]
    assert ckpt.complete_checkpoints(tmp_path) == [tmp_path / "step_000002"]
    ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_hf_loads_with_from_pretrained_and_gives_same_logits(mesh, tmp_path, tied):
    model, opt, sched = build_sharded(mesh, seed=0, tied=tied)
    _train(model, opt, sched, range(2))  # move the weights away from their init
    model.config.use_cache = False  # as the engine sets it for training
    ckpt.export_hf(tmp_path / "hf", model=model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.use_cache  # the export is for inference, whatever training set
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    _assert_same({n: p.detach() for n, p in loaded.named_parameters()}, full_params(model))
    x = _batch(99)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, use_cache=False).logits, model(x, use_cache=False).logits,
                                   atol=1e-6, rtol=0)


def test_engine_export_hf_gives_the_same_log_probs_as_infer_batch(tmp_path):
    from tensordict import TensorDict

    from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
    from polyfsdp.engines.engine import FSDPEngine
    from polyfsdp.engines.losses import SFTLoss

    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny-tied", seed=4), EngineConfig(),
                        OptimConfig(lr=1e-2)).initialize()
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (7, 1, 12, 4)]

    def jagged(parts):
        lengths = torch.tensor([len(p) for p in parts])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets, min_seqlen=int(lengths.min()),
                                                      max_seqlen=int(lengths.max()))

    masks = [torch.ones(len(s)) for s in seqs]
    for m in masks:
        m[-1] = 0
    engine.train_batch(TensorDict({"input_ids": jagged(seqs), "response_mask": jagged(masks)}, batch_size=[4]),
                       SFTLoss())
    engine.export_hf(tmp_path / "hf")
    engine_lp = engine.infer_batch(TensorDict({"input_ids": jagged(seqs)}, batch_size=[4]))["log_probs"]

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        for seq, lp in zip(seqs, engine_lp.unbind()):
            # Independent reference: the exported model on this sequence alone.
            log_softmax = torch.log_softmax(loaded(seq[None], use_cache=False).logits[0].double(), -1)
            expected = torch.zeros(len(seq), dtype=torch.float64)
            expected[:-1] = log_softmax[torch.arange(len(seq) - 1), seq[1:]]
            torch.testing.assert_close(lp.double(), expected, atol=1e-5, rtol=0)


def test_a_background_save_writes_the_state_of_its_step_while_training_goes_on(mesh, tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model, opt, sched = build_sharded(mesh, seed=0)
    _train(model, opt, sched, range(1))
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, lr_scheduler=sched)
    _train(model, opt, sched, [1])
    saved_params, saved_optim = full_params(model), _optim_state(opt)

    import threading
    trained = threading.Event()
    real_write = FileSystemWriter.write_data

    def write_after_training(self, *args, **kwargs):
        assert trained.wait(60)  # the shards are written only once the next step has changed the model
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_after_training)
    pending = ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, lr_scheduler=sched, background=True)
    assert isinstance(pending, ckpt.PendingCheckpoint) and not pending.done()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000001"  # not before the write is complete
    assert (tmp_path / ".tmp-step_000002").is_dir() and not (tmp_path / ".tmp-step_000002" / "manifest.json").exists()
    _train(model, opt, sched, [2])  # training goes on while the save is pending
    trained.set()
    assert pending.wait() == tmp_path / "step_000002"
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    ckpt.verify_checkpoint(tmp_path / "step_000002")

    other, other_opt, other_sched = build_sharded(mesh, seed=1)
    assert ckpt.load_checkpoint(tmp_path, model=other, optimizer=other_opt, lr_scheduler=other_sched)[0] == 2
    _assert_same(full_params(other), saved_params)  # the state at the save, not after the step that followed
    _assert_same(_optim_state(other_opt), saved_optim)


def test_a_background_save_that_fails_raises_at_wait_and_keeps_the_previous_checkpoint(mesh, tmp_path, monkeypatch):
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    model, opt, sched = build_sharded(mesh, seed=0)
    first = ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/injected/file")

    monkeypatch.setattr(dcp_filesystem, "_write_item", disk_full)
    pending = ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, background=True)
    with pytest.raises(ckpt.CheckpointSaveError, match=r"No space left on device \(/injected/file\); .*step_000001 "
                                                       r"stays the latest checkpoint$"):
        pending.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert ckpt.latest_checkpoint(tmp_path) == first
