"""Empty completions (no token to train on: an aborted generation) never crash an RL step: they
are counted (``empty_completions``), left out of their group's statistics and of the loss, so a
partly empty batch trains as the batch without them (token-mean); a step whose rows are all empty
is skipped with no update; a GRPO job whose sampler returns nothing for a step completes."""
import torch
import pytest

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig
from polyfsdp.trainer.algos.advantages import GROUP_ESTIMATORS, group_advantages
from polyfsdp.trainer.algos.rl_step import RLContext, SampledBatch, empty_step_warning, train_batch
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.rollout.drivers.result import Rollout
from polyfsdp.trainer.rollout.engines import Completions
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main
from tests.helpers.vllm_cases import write_checkpoint

TOK = CharTokenizer()


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_an_empty_completion_is_left_out_of_its_group(estimator):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.9, 0.3, 0.7, 0.2, 0.6])
    present = torch.tensor([True, True, True, False, True, False, False, False])
    adv = group_advantages(rewards, 4, estimator, present=present)
    without = group_advantages(torch.tensor([1.0, 0.0, 0.5]), 3, estimator)
    assert adv[:3].tolist() == pytest.approx(without.tolist(), abs=1e-6)
    # the empty row, and a group with one sample left (no baseline), get 0
    assert adv[3:].tolist() == [0.0] * 5
    everything = torch.ones(8, dtype=torch.bool)
    assert torch.equal(group_advantages(rewards, 4, estimator, present=everything), group_advantages(rewards, 4, estimator))


def _policy(tmp_path, name):
    path = write_checkpoint(tmp_path / name, "qwen2-tiny", TOK, seed=5)
    return FSDPEngine(ModelConfig(path=path), EngineConfig(), OptimConfig(lr=0.05)).initialize()


def _train(tmp_path, name, group_size, mini_batch_size, rows):
    """One train_batch of a fresh policy on ``rows`` (prompt, response, reward); its record and weights."""
    cfg = load_config(["algo.actor.kl_coef=0", f"algo.actor.group_size={group_size}", "algo.actor.agg_mode=token-mean",
                       f"algo.actor.mini_batch_size={'null' if mini_batch_size is None else mini_batch_size}"])
    prompts = len(rows) // group_size
    policy = _policy(tmp_path, name)
    ctx = RLContext(policy, TOK, cfg.algo, cfg.algo.actor_loss(prompts),
                    mini_batches=cfg.algo.actor.mini_batches(prompts))
    roll = Rollout([p for p, _, _ in rows], [r for _, r, _ in rows], [TOK.decode(r) for _, r, _ in rows],
                   [x for _, _, x in rows])
    record = train_batch(ctx, SampledBatch(roll, {}), shuffle_seed=3)
    return record, {k: v.detach().clone() for k, v in policy.module.state_dict().items()}


def _ids(text):
    return TOK.encode(text)


A, B, C = (_ids("abc"), _ids("xyz"), 1.0), (_ids("abc"), _ids("zq"), 0.0), (_ids("abc"), _ids("q"), 0.5)
D, E = (_ids("dd"), _ids("hello"), 1.0), (_ids("dd"), _ids("hi"), 0.0)


def _same_update(with_empty, without):
    (record, weights), (expected, expected_weights) = with_empty, without
    for key in ("loss", "grad_norm", "pg_loss", "entropy", "updates"):
        if key in expected:
            assert record[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    for name, tensor in expected_weights.items():
        assert torch.allclose(weights[name], tensor, atol=1e-6), name


def test_a_partly_empty_group_trains_as_the_group_without_its_empty_row(tmp_path):
    empty = (_ids("abc"), [], 0.7)  # its reward would move the others' baseline
    _same_update(_train(tmp_path, "with", 4, None, [A, B, empty, C]), _train(tmp_path, "without", 3, None, [A, B, C]))


def test_an_empty_group_in_its_own_mini_batch_is_no_optimizer_step(tmp_path):
    empty = (_ids("dd"), [], 0.0)
    with_empty = _train(tmp_path, "with", 2, 1, [D, E, empty, empty])  # 2 mini-batches: one is empty
    assert with_empty[0]["updates"] == 1
    _same_update(with_empty, _train(tmp_path, "without", 2, 1, [D, E]))


def test_a_step_whose_rows_are_all_empty_is_skipped_without_an_update(tmp_path):
    empty = (_ids("dd"), [], 0.0)
    record, weights = _train(tmp_path, "skipped", 2, None, [empty, empty])
    assert record["updates"] == 0 and record["skipped_empty"] == 1 and "loss" not in record
    fresh = _policy(tmp_path, "fresh").module.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in fresh.items())
    assert "rl step 7 skipped, no update" in empty_step_warning({**record, "empty_completions": 2.0}, 7)
    assert empty_step_warning(_train(tmp_path, "trained", 2, None, [D, E])[0], 7) is None


def test_a_grpo_run_whose_sampler_returns_nothing_for_a_step_completes_and_counts_them(tmp_path, monkeypatch, capfd):
    from polyfsdp.trainer.rollout import generate as generation

    real, calls = generation.generate, []

    def aborted_second_rollout(engine, prompts, params, **options):
        calls.append(len(prompts))
        out = real(engine, prompts, params, **options)
        if len(calls) == 2:  # the second RL step's rollout: every completion empty
            return Completions([[] for _ in prompts], None if out.log_probs is None else [[] for _ in prompts])
        if len(calls) == 3:  # the third: half of them
            return Completions([ids if i % 2 else [] for i, ids in enumerate(out.token_ids)],
                               None if out.log_probs is None else
                               [lp if i % 2 else [] for i, lp in enumerate(out.log_probs)])
        return out

    monkeypatch.setattr(generation, "generate", aborted_second_rollout)
    threads = torch.get_num_threads()
    try:
        code = main(["trainer.sft_steps=0", "trainer.rl_steps=3", "trainer.prompts_per_step=2",
                     "algo.actor.group_size=2", "algo.actor.max_new_tokens=4", "data.eval_size=2",
                     "eval.initial=false", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
                     f"trainer.output_dir={tmp_path / 'run'}"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    said = capfd.readouterr()
    assert "global_num_tokens" not in said.err and "Traceback" not in said.err
    assert said.out.count("warning: rl step 2 skipped, no update: its 4 completion(s) hold no token") == 1
    assert said.out.count("skipped, no update") == 1
    rl = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["phase"] == "rl"]
    assert [r["empty_completions"] for r in rl] == [0.0, 4.0, 2.0]
    assert [r["updates"] for r in rl] == [1, 0, 1] and [r.get("skipped_empty") for r in rl] == [None, 1.0, None]
    assert "loss" not in rl[1] and "loss" in rl[2]
