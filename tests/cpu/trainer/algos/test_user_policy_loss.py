"""A user's policy loss from a file outside polyfsdp (``algo.actor.policy_loss=FILE.py:NAME``,
tests/helpers/custom_policy_loss.py): PPO written again equals the built-in exactly (values, metrics,
gradients), CISPO's clipped-weight rule matches a float64 reference written per token, one trains
through polyfsdp-train, and every malformed one is one line with a non-zero exit."""
import math

import pytest
import torch

from tests.helpers import HELPERS
from tests.helpers.loss_cases import loss_inputs_from_sequences
from polyfsdp.engines.losses import is_token_separable
from polyfsdp.trainer.algos.policy_losses import policy_loss_entry, wrap_user_loss
from polyfsdp.trainer.config.job import load_config

FILE = HELPERS / "custom_policy_loss.py"


def _inputs(seed: int = 0, spread: float = 0.4, dtype=torch.float32):
    """Ragged sequences with a prompt part (mask 0), one without response tokens, ratios spread
    far enough from 1 that both clip bounds bite, and every field a policy loss may read."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [4, 7, 1, 5, 6, 40, 60], [1, 2, 1, 0, 3, 5, 10]
    logp = [-torch.rand(n, generator=g, dtype=torch.float64) * 2 for n in lengths]
    near = lambda: [lp + spread * torch.randn(len(lp), generator=g, dtype=torch.float64) for lp in logp]  # noqa: E731
    masks = [torch.tensor([0.0] * p + [1.0] * (n - p), dtype=torch.float64) for n, p in zip(lengths, prompts)]
    masks[2] = torch.zeros(1, dtype=torch.float64)
    adv = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    fields = {"response_mask": masks, "advantages": adv, "old_log_probs": near(), "ref_log_probs": near(),
              "rollout_log_probs": near()}
    entropy = [torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    cast = lambda seqs: [s.to(dtype) for s in seqs]  # noqa: E731
    inputs = loss_inputs_from_sequences(cast(logp), {k: cast(v) for k, v in fields.items()}, cast(entropy))
    inputs.log_probs.requires_grad_()
    return inputs


def _loss(name: str, overrides: list[str]):
    spec = name if name == "ppo" else f"{FILE}:{name}"
    return load_config([f"algo.actor.policy_loss={spec}", *overrides]).algo.actor_loss(32)


@pytest.mark.parametrize("overrides", [
    [],
    ["algo.actor.epochs=2"],
    ["algo.actor.epochs=2", "algo.actor.dual_clip_c=3", "algo.actor.kl_type=k1"],
    ["algo.actor.epochs=2", "algo.rollout_correction.tis_cap=1.5", "algo.actor.agg_mode=seq-mean-token-sum"],
    ["algo.actor.epochs=2", "algo.actor.clip_ratio_low=0.1", "algo.actor.clip_ratio_high=0.15"],
], ids=["on-policy", "off-policy", "dual-clip", "tis", "clip-range"])
def test_ppo_written_again_in_a_file_equals_the_builtin_exactly(overrides):
    builtin, user = _loss("ppo", overrides), _loss("ppo_again", overrides)
    assert type(user.user_loss).__name__ == "PPOAgain" and vars(user.user_loss) == vars(builtin)  # same settings
    assert is_token_separable(user)  # as its class declares: the fused head may take it, as it takes ppo
    a, b = _inputs(), _inputs()
    loss_a, metrics_a = builtin(a)
    loss_b, metrics_b = user(b)
    loss_a.backward()
    loss_b.backward()
    # Bit for bit, not to float32 rounding: PPOAgain runs the built-in's torch ops in the same order
    # on tensors of the same shapes (elementwise ops, then the same reductions), so every CPU kernel
    # set (AVX-512, AVX2, no SIMD) rounds both alike; a rewrite that reorders them would not be exact.
    assert torch.equal(loss_a, loss_b) and torch.equal(a.log_probs.grad, b.log_probs.grad)
    assert metrics_a.keys() == metrics_b.keys() and all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)
    if "algo.actor.epochs=2" in overrides:  # not vacuous: off policy, the clip bites
        assert 0 < float(metrics_a["clip_frac_low"]) and 0 < float(metrics_a["clip_frac_high"])
        assert float(metrics_a["clip_frac"]) < 1


def _reference_clipped_weight(inputs, low: float, high: float, agg_mode: str):
    """CISPO's policy-gradient term in float64, token by token: -A * clip(ratio, 1 - low, 1 + high)
    * logp with the weight held constant; value and d/d logp, token-mean or seq-mean-token-mean."""
    f = {k: v.double() for k, v in inputs.fields.items()}
    logp = inputs.log_probs.detach().double()
    offsets = inputs.offsets.tolist()
    value, grad = 0.0, torch.zeros_like(logp)
    for s in range(len(offsets) - 1):
        tokens = [t for t in range(offsets[s], offsets[s + 1]) if f["response_mask"][t] == 1]
        scale = 1.0 / inputs.global_num_tokens if agg_mode == "token-mean" else \
            1.0 / (max(len(tokens), 1) * inputs.global_num_seqs)
        for t in tokens:
            weight = min(max(math.exp(float(logp[t] - f["old_log_probs"][t])), 1 - low), 1 + high)
            value += -float(f["advantages"][t]) * weight * float(logp[t]) * scale
            grad[t] = -float(f["advantages"][t]) * weight * scale
    return value, grad


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_a_users_clipped_weight_loss_matches_a_float64_reference(agg_mode):
    loss_fn = _loss("clipped_weight", ["algo.actor.epochs=2", "algo.actor.kl_coef=0", "algo.actor.entropy_coef=0",
                                       f"algo.actor.agg_mode={agg_mode}"])
    assert (loss_fn.clip_ratio_low, loss_fn.clip_ratio_high) == (0.5, 0.2)  # the entry's defaults
    undeclared = policy_loss_entry(f"{FILE}:raises")  # a user's class that does not declare it
    assert not is_token_separable(wrap_user_loss(undeclared(), "raises"))
    inputs = _inputs()
    loss, metrics = loss_fn(inputs)
    loss.backward()
    value, grad = _reference_clipped_weight(inputs, 0.5, 0.2, agg_mode)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(inputs.log_probs.grad.double(), grad, atol=1e-7, rtol=1e-6)
    assert 0 < float(metrics["clip_frac"]) < 1  # some weights clipped, some not
    # PPO's clip zeroes a clipped token's gradient; this rule keeps it (the two differ).
    ppo = _inputs()
    loss_ppo, _ = _loss("ppo", ["algo.actor.epochs=2", "algo.actor.kl_coef=0", "algo.actor.entropy_coef=0",
                                f"algo.actor.agg_mode={agg_mode}"])(ppo)
    loss_ppo.backward()
    assert not torch.allclose(ppo.log_probs.grad, inputs.log_probs.grad)


def test_a_users_policy_loss_by_module_name(monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))
    loss = load_config(["algo.actor.policy_loss=custom_policy_loss:clipped_weight"]).algo.actor_loss(32)
    assert type(loss.user_loss).__name__ == "ClippedWeightLoss"


def test_a_users_policy_loss_trains_through_polyfsdp_train(tmp_path):
    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    spec = f"{FILE}:clipped_weight"
    calls = policy_loss_entry(spec).loss_class._policy_gradient.__globals__["CALLS"]  # the file, imported once
    calls.clear()
    out = tmp_path / "run"
    code = main(["trainer.sft_steps=1", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
                 "algo.actor.group_size=4", "algo.actor.epochs=2", "data.eval_size=8", "trainer.progress=off",
                 "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0",
                 f"algo.actor.policy_loss={spec}", f"trainer.output_dir={out}"])
    assert code == 0
    assert len(calls) >= 1 + 4  # the config's check, then 2 steps x 2 updates of at least one micro-batch
    records = read_metrics(str(out / "metrics.jsonl"))
    updates = [r for r in records if r["phase"] == "rl_update"]
    assert [(u["step"], u["update"]) for u in updates] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(math.isfinite(u[k]) for u in updates for k in ("pg_loss", "ratio_mean", "clip_frac", "grad_norm"))
    assert all(u["ratio_max"] != 1.0 for u in updates if u["update"] == 2)  # off policy on the second update


def test_ppo_written_again_trains_like_the_builtin(tmp_path):
    """Through the engine (the fused head takes both: both declare token_separable): the same records to
    float32 rounding. The loss is op for op the built-in's (the test above), but the engine runs the LM
    head on the response rows alone only for a loss whose own class declares masked_positions_only
    (PPOLoss does; the user's PPOAgain and its wrapper do not), so the user's run computes its log-probs
    through the whole head: other GEMM shapes, other rounding (on AVX-512 the second RL update's loss
    differs in its last float32 bits). Two formulations: the records are compared with the suite's
    formulation tolerance (tests/helpers/exactness.py), counts exactly."""
    from polyfsdp.trainer.tracking.metrics import read_metrics
    from tests.helpers.exactness import assert_formulations_agree
    from polyfsdp.trainer.train import main

    runs = {}
    for name, spec in (("builtin", "ppo"), ("user", f"{FILE}:ppo_again")):
        out = tmp_path / name
        assert main(["trainer.sft_steps=1", "trainer.rl_steps=2", "trainer.sft_batch_size=8",
                     "trainer.prompts_per_step=4", "algo.actor.group_size=4", "algo.actor.epochs=2", "data.eval_size=8",
                     "trainer.progress=off", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0",
                     f"algo.actor.policy_loss={spec}", f"trainer.output_dir={out}"]) == 0
        runs[name] = [{k: v for k, v in r.items() if not k.endswith("time_s") and k != "tokens_per_s"}
                      for r in read_metrics(str(out / "metrics.jsonl"))]
    assert any(r["phase"] == "rl_update" and r["clip_frac"] > 0 for r in runs["builtin"])  # the clip mattered
    assert_formulations_agree(runs["user"], runs["builtin"])


@pytest.mark.parametrize("value, expected", [
    ("ppp", "algo.actor.policy_loss: got 'ppp'; allowed values: ppo, gspo, gspo_token, or path/to/file.py:NAME / "
            "package.module:NAME of your own (did you mean ppo?)"),
    ("no_such_file.py:loss", "algo.actor.policy_loss=no_such_file.py:loss: no such file 'no_such_file.py'"),
    (f"{FILE}:missing", "has no policy loss 'missing'"),
    ("no_such_module_xyz:loss", "cannot import module 'no_such_module_xyz'"),
    (f"{FILE}:Unregistered", "Unregistered is not a policy loss; register it as PolicyLoss(name, LossClass, summary"),
    (f"{FILE}:CALLS", "is not callable"),
    (f"{FILE}:not_a_loss_class", "loss_class must be a subclass of polyfsdp.engines.losses.PPOLoss, got <class 'dict'>"),
    (f"{FILE}:low_above_one", "clip_ratio_low must be a number in [0, 1), got 1.5"),
    (f"{FILE}:bad_agg_mode", "agg_mode must be None or one of token-mean, "),
    (f"{FILE}:unknown_option", "PPOAgain(...) raised TypeError: "),
    (f"{FILE}:raises", "raised KeyError: 'missing' at "),
    (f"{FILE}:no_tuple", "the loss returned Tensor; its __call__ must return (loss, metrics)"),
    (f"{FILE}:no_gradient", "the loss has no finite gradient with respect to the log-probs"),
])
def test_a_malformed_policy_loss_is_one_line_and_a_nonzero_exit(tmp_path, capsys, value, expected):
    from polyfsdp.trainer.train import main

    extra = ["algo.actor.kl_coef=0"] if value.endswith(":no_gradient") else []  # else the KL term gives one
    code = main([f"algo.actor.policy_loss={value}", *extra, f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert expected in err[0] and "algo.actor.policy_loss" in err[0], err[0]
    if value.endswith(":raises"):
        assert "custom_policy_loss.py:" in err[0]  # the user's file:line
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the job started


def test_a_users_loss_failing_during_training_is_one_line_naming_it(tmp_path, capsys):
    """It passes the config's check (2 sequences) and raises on the job's first update (8)."""
    from polyfsdp.trainer.train import main

    spec = f"{FILE}:fails_on_bigger_batches"
    code = main(["trainer.sft_steps=0", "trainer.rl_steps=1", "trainer.prompts_per_step=2", "algo.actor.group_size=4",
                 "data.eval_size=4", "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
                 "trainer.checkpoint_interval=0", f"algo.actor.policy_loss={spec}", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert f"algo.actor.policy_loss={spec} raised RuntimeError: 8 sequences" in err[0], err[0]
    assert "custom_policy_loss.py:" in err[0] and "(a micro-batch of " in err[0], err[0]
