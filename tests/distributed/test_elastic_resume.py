"""Elastic resume: a checkpoint saved on N ranks loads on M (gloo). The policy, a PPO critic and
LoRA adapters come back exactly with their optimizer states, whatever M is; each rank hashes
only the files it reads (rank 0 also the ones no rank reads); a damaged shard that only some
ranks read fails every rank with the same line; RNG states stay untouched on another world size;
an SFT curve and an RL run (its completions seeded per global sample) continued on one rank
follow the uninterrupted one-rank run."""
import os
import subprocess
import sys

import pytest
import torch

from torchrun_launcher import run_torchrun

from tests.helpers import root_on_pythonpath

WORKER = os.path.join(os.path.dirname(__file__), "worker_elastic.py")
SHARED = {".metadata", "trainer_state.pt"}


def _run(mode, out, world):
    if world == 1:  # a plain process: one rank without torchrun
        env = root_on_pythonpath({**os.environ, "POLYFSDP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"})
        result = subprocess.run([sys.executable, WORKER, mode, str(out)], capture_output=True, text=True,
                                timeout=300, env=env)
    else:
        result = run_torchrun(WORKER, nproc=world, args=(mode, str(out)))
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / f"{mode}_world{world}.pt"), torch.load(out / f"{mode}_ranks_world{world}.pt")


def _assert_equal(saved, loaded):
    for engine in ("policy", "critic", "lora"):
        params, optim = saved[engine]["params"], saved[engine]["optim"]
        assert params and loaded[engine]["params"].keys() == params.keys(), engine
        for name, value in params.items():
            assert torch.equal(loaded[engine]["params"][name], value), (engine, name)
        assert optim and loaded[engine]["optim"].keys() == optim.keys(), engine
        for name, state in optim.items():
            assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}, (engine, name)
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(loaded[engine]["optim"][name][key]), torch.as_tensor(value)), \
                    (engine, name, key)
    assert any(".lora_" in name for name in saved["lora"]["params"]) and \
        all(".lora_" in name for name in saved["lora"]["params"])  # only the adapters are trained and saved
    assert any("lm_head" in name for name in saved["critic"]["params"])


def _assert_one_verdict(ranks, out, world, shard="__0_0.distcp"):
    line = f"CheckpointDamaged: {out / f'damaged_world{world}' / 'step_000002'}: {shard} does not match its checksum " \
           f"(damaged)"
    assert [r["damaged_error"] for r in ranks] == [line] * world


def test_two_rank_checkpoint_resumes_on_one_and_four_ranks_exactly(tmp_path):
    saved, _ = _run("save", tmp_path, 2)
    shards = {"__0_0.distcp", "__1_0.distcp"}

    one, (rank0,) = _run("load", tmp_path, 1)
    _assert_equal(saved, one)
    assert rank0["step"] == 2 and rank0["rng_kept"]
    # One rank reads every shard; it hashes each file once, the saved ranks' RNG files too.
    assert rank0["hashed"] == sorted(SHARED | shards | {"rng_rank0.pt", "rng_rank1.pt"})
    _assert_one_verdict([rank0], tmp_path, 1)

    four, ranks = _run("load", tmp_path, 4)
    _assert_equal(saved, four)
    assert [r["step"] for r in ranks] == [2] * 4 and all(r["rng_kept"] for r in ranks)
    # Four ranks split each saved shard in two: ranks 0 and 1 read __0_0 (rank 1 also the start
    # of __1_0, where its rows begin), ranks 2 and 3 only __1_0; rank 0 hashes the RNG files no
    # rank of this world reads.
    hashed = [set(r["hashed"]) for r in ranks]
    rng_files = {"rng_rank0.pt", "rng_rank1.pt"}
    for rank, files in enumerate(hashed):
        # The shared files, the shards it reads, and on rank 0 the RNG files no rank of 4 reads.
        assert files == SHARED | set(ranks[rank]["hashed"]) and files - SHARED <= shards | rng_files, (rank, files)
    assert rng_files <= hashed[0] and not any(rng_files & files for files in hashed[1:])
    # Ranks 2 and 3 hold rows of saved rank 1's half only (a replicated item DCP stored once, in
    # either file, can add one; the weights are what is large): they never hash __0_0.distcp.
    assert hashed[2] - SHARED == hashed[3] - SHARED == {"__1_0.distcp"}
    assert "__0_0.distcp" in hashed[0] and "__0_0.distcp" in hashed[1]
    # A byte flipped in __0_0.distcp is found by ranks 0 and 1; ranks 2 and 3, which never read
    # it, stop with the same line.
    _assert_one_verdict(ranks, tmp_path, 4)


def test_one_rank_checkpoint_resumes_on_two_ranks_exactly(tmp_path):
    saved, _ = _run("save", tmp_path, 1)
    two, ranks = _run("load", tmp_path, 2)
    _assert_equal(saved, two)
    assert all(r["rng_kept"] and r["step"] == 2 for r in ranks)
    assert [set(r["hashed"]) for r in ranks] == [SHARED | {"__0_0.distcp", "rng_rank0.pt"}, SHARED | {"__0_0.distcp"}]
    _assert_one_verdict(ranks, tmp_path, 2)


def _continued_on_one_rank(tmp_path, base, key, saved, total, phase):
    """A run of ``key=saved`` steps on 2 ranks continued to ``key=total`` on one rank, and the
    uninterrupted one-rank run: ``(the resumed process, its phase records, the reference's)``."""
    from test_trainer_torchrun import _launch

    from polyfsdp.trainer.tracking.metrics import read_metrics

    first = _launch(tmp_path / "run", 2, f"{key}={saved}", base=base)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _launch(tmp_path / "run", 1, f"{key}={total}", "trainer.resume=auto", base=base)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = _launch(tmp_path / "one", 1, f"{key}={total}", base=base)
    assert reference.returncode == 0, reference.stderr[-3000:]
    got, expected = ([r for r in read_metrics(str(tmp_path / name / "metrics.jsonl")) if r["phase"] == phase]
                     for name in ("run", "one"))
    return resumed, got, expected


def test_a_two_rank_sft_run_continues_on_one_rank_along_the_one_rank_curve(tmp_path):
    sft = ["algo=sft", "trainer.sft_batch_size=8", "data.eval_size=9", "trainer.progress=lines", "trainer.plot=false",
           "trainer.export=false", "trainer.checkpoint_interval=2"]
    resumed, got, expected = _continued_on_one_rank(tmp_path, sft, "trainer.sft_steps", 2, 4, "sft")
    checkpoint = tmp_path / "run" / "checkpoints" / "sft" / "step_000002"
    assert f"resuming sft from {checkpoint}" in resumed.stdout
    assert f"elastic resume: {checkpoint} was saved on 2 rank(s), this run has 1: model and optimizer resharded, " \
           f"RNG states not restored (every step seeds its own)" in resumed.stdout
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3, 4]
    # The SFT batch of a step is the same whatever the world size; only the order of the rank sum
    # differs (2 ranks for steps 1-2), so the curves agree to rounding, not to the bit.
    for a, b in zip(got, expected):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_a_two_rank_rl_run_continues_on_one_rank_drawing_the_one_rank_completions(tmp_path):
    from test_trainer_torchrun import _assert_same_rollouts

    rl = ["trainer.sft_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4", "algo.actor.group_size=4",
          "data.eval_size=9", "trainer.progress=lines", "trainer.plot=false", "trainer.export=false",
          "trainer.checkpoint_interval=1"]
    resumed, got, expected = _continued_on_one_rank(tmp_path, rl, "trainer.rl_steps", 1, 3, "rl")
    checkpoint = tmp_path / "run" / "checkpoints" / "rl" / "step_000001"
    assert f"elastic resume: {checkpoint} was saved on 2 rank(s), this run has 1" in resumed.stdout
    # Step 1 on two ranks, steps 2-3 on one: every rollout drew the one-rank run's completions.
    _assert_same_rollouts(got, expected)
    assert [r["step"] for r in got] == [1, 2, 3]
