"""polyfsdp-train end to end: the default job and non-default modes, SFT-only, bad
overrides, a local model directory, and resume after SIGKILL."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyfsdp.trainer.tracking.metrics import TIMING_KEYS, read_metrics
from polyfsdp.trainer.train import main
from tests.helpers.kill_at_checkpoint import kill_after_checkpoint

# Few, small steps: every phase, evaluation, checkpoint and export still runs.
TINY = [
    "trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
    "data.eval_size=8", "trainer.progress=lines",
]
TINY_GRPO = ["algo.actor.group_size=4"]
NON_DEFAULT_MODES = ["engine.use_remove_padding=false", "engine.use_fused_kernels=true", "engine.pad_mode=left_right",
                     "engine.max_tokens_per_micro_batch=40"]



def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, list[dict]]:
    out = tmp_path / name
    grpo = [] if "algo=sft" in overrides else TINY_GRPO
    code = main([*TINY, *grpo, f"trainer.output_dir={out}", *overrides])
    assert code == 0
    return out, read_metrics(str(out / "metrics.jsonl"))


def _steps(records, phase):
    return [r for r in records if r["phase"] == phase]


def _evals(records):
    return {r["tag"]: r["reward"] for r in records if r["phase"] == "eval"}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("default")
    threads = torch.get_num_threads()
    try:
        return _run(tmp, "run")
    finally:
        torch.set_num_threads(threads)


def test_default_job_runs_sft_then_grpo_and_writes_everything(default_run):
    out, records = default_run
    assert [r["step"] for r in _steps(records, "sft")] == [1, 2]
    grpo = _steps(records, "rl")
    assert [(r["step"], r["global_step"]) for r in grpo] == [(1, 3), (2, 4)]
    for r in grpo:
        assert 0.0 <= r["reward"] <= 1.0
        for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "tokens_per_s"):
            assert math.isfinite(r[key]), key
    assert set(_evals(records)) == {"initial", "after_sft", "final"}
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "checkpoints" / "rl" / "latest").is_file()
    # The export is an ordinary Hugging Face checkpoint with the character tokenizer.
    from transformers import AutoModelForCausalLM

    from polyfsdp.trainer.data.tokenizers import CharTokenizer, load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert isinstance(load_tokenizer(str(out / "final")), CharTokenizer)
    assert model.config.vocab_size == CharTokenizer().vocab_size


def test_non_default_modes_train_to_the_same_numbers(default_run, tmp_path):
    # No remove-padding + fused log-probs + left_right batches + micro-batches: same data,
    # same seeds, so every loss must match the default modes (fp32) and greedy evaluations
    # must agree.
    _, reference = default_run
    _, records = _run(tmp_path, "modes", *NON_DEFAULT_MODES)
    for phase in ("sft", "rl"):
        ours, theirs = _steps(records, phase), _steps(reference, phase)
        assert len(ours) == len(theirs) == 2
        for a, b in zip(ours, theirs):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), (phase, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (phase, a["step"])
    # Rewards and greedy evaluations score tokens: the same tokens give the same numbers, and a
    # tolerance could not absorb a different token. The weights differ by float32 rounding only,
    # which no sampled or greedy token of these runs is close enough to a tie to feel.
    assert [r["reward"] for r in _steps(records, "rl")] == [r["reward"] for r in _steps(reference, "rl")]
    assert _evals(records) == _evals(reference)


def test_sft_only_job_trains_evaluates_and_exports(tmp_path):
    out, records = _run(tmp_path, "sft", "algo=sft")
    assert [r["step"] for r in _steps(records, "sft")] == [1, 2]
    assert not _steps(records, "rl")
    assert set(_evals(records)) == {"initial", "final"}
    assert (out / "final" / "config.json").is_file()
    assert not (out / "sft_model").exists()


def test_model_path_loads_weights_and_tokenizer_from_directory(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from polyfsdp.trainer.data.sources import BuiltinSource
    from polyfsdp.trainer.data.tokenizers import CharTokenizer
    from polyfsdp.trainer.data.task import ReverseTask

    # A tokenizer unlike the default one: if the run used the default, the ids (and the
    # loss) would differ.
    tok = CharTokenizer("hgfedcba=")
    config = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(123)
    model_dir = tmp_path / "my_model"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tok.save_pretrained(str(model_dir))

    out, records = _run(tmp_path, "run", f"model.path={model_dir}", "algo=sft", "trainer.sft_steps=1",
                        "trainer.export=false", "trainer.plot=false")
    first = _steps(records, "sft")[0]
    # config.yaml records the model that ran: the directory, not the preset's unused overrides.
    saved = (out / "config.yaml").read_text()
    assert f"path: {model_dir}" in saved and "preset: null" in saved and "hidden_size" not in saved

    # Independent reference: the saved model, one sequence at a time, token-mean NLL of
    # answer + eos over the first step's examples (the data is a function of seed and step).
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    examples = BuiltinSource(ReverseTask(), seed=0, eval_size=8).batch("sft", 0, 8)
    nll, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            prompt = [tok.bos_token_id] + tok.encode(ex.prompt)
            answer = tok.encode(ex.answer) + [tok.eos_token_id]
            ids = torch.tensor([prompt + answer])
            logp = torch.log_softmax(ref(ids).logits[0, :-1].double(), -1)
            targets = ids[0, 1:]
            token_lp = logp.gather(-1, targets[:, None])[:, 0]
            nll -= float(token_lp[len(prompt) - 1:].sum())
            count += len(answer)
    assert first["loss"] == pytest.approx(nll / count, abs=1e-5)


def _cli(*args: str, console_script: bool = False, **kwargs) -> subprocess.CompletedProcess:
    command = ["polyfsdp-train"] if console_script else [sys.executable, "-m", "polyfsdp.trainer.train"]
    env = {**os.environ, "POLYFSDP_BACKEND": ""}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=env, **kwargs)


def _assert_one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("polyfsdp-train: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize("overrides,expected", [
    (["engine.use_remov_padding=false"], "engine.use_remov_padding: unknown key"),
    (["engine.pad_mode=sideways"], "engine.pad_mode: got 'sideways'; allowed values: 'no_padding', 'left_right'"),
    (["model=gpt5"], "model=gpt5: no such option; choose one of llama, qwen2, qwen2_vl, qwen3"),
])
def test_bad_override_exits_nonzero_with_one_line(overrides, expected, tmp_path):
    proc = _cli(*overrides, f"trainer.output_dir={tmp_path / 'x'}", console_script=overrides[0].startswith("engine.use"))
    _assert_one_line_error(proc, expected)
    assert not (tmp_path / "x").exists()


def test_unusable_backend_exits_with_the_backends_reason(tmp_path):
    from polyfsdp.backends import available_backends

    status = {s.name: s for s in available_backends()}["npu"]
    if status.available:
        pytest.skip("an NPU is usable here")
    proc = _cli("backend=npu", f"trainer.output_dir={tmp_path / 'x'}")
    _assert_one_line_error(proc, f"backend 'npu' is not usable: {status.reason}")


def _comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# Update-many with shuffled mini-batches, group filtering (extra sampling rounds) and TIS:
# every new source of randomness must be seeded per step for the resumed curve to match.
UPDATE_MANY = ["algo.actor.epochs=2", "algo.actor.mini_batch_size=2", "algo.actor.filter_groups=true",
               "algo.adv_estimator=rloo", "algo.rollout_correction.tis_cap=2.0"]


# PPO: the critic's checkpoint must resume too (its values decide the advantages after the kill).
PPO_CRITIC = ["algo=ppo", "algo.actor.epochs=2", "algo.actor.mini_batch_size=2", "algo.critic.critic_warmup=1"]


def _multi_turn_env():
    from tests.cpu.trainer.rollout.test_multi_turn import GUESS_ENV

    # 30 SFT steps teach <eos>, so conversations go past their first turn (asserted below).
    return [f"rollout.env={GUESS_ENV}", "rollout.max_turns=3", "+rollout.env_kwargs.target=c", "trainer.sft_steps=30"]


@pytest.mark.parametrize("algo", [[], UPDATE_MANY, PPO_CRITIC, _multi_turn_env()],
                         ids=["default", "update_many", "ppo_critic", "multi_turn"])
def test_resume_after_sigkill_continues_the_same_curve(tmp_path, algo):
    overrides = [*TINY, *TINY_GRPO, "trainer.sft_steps=4", "trainer.rl_steps=4", "trainer.checkpoint_interval=2",
                 "trainer.plot=false", "trainer.export=false", *algo]
    # Uninterrupted reference run.
    _, reference = _run(tmp_path, "full", *overrides[len(TINY) + len(TINY_GRPO):])
    if any(o.startswith("rollout.env=") for o in algo):  # the environment must have answered some turns
        assert max(r.get("multi_turn/turns_mean", 0.0) for r in reference) > 1.0

    out = tmp_path / "killed"
    proc, seen = kill_after_checkpoint([*overrides, f"trainer.output_dir={out}"])
    assert proc.returncode == -signal.SIGKILL, "".join(seen)

    resumed = _cli(*overrides, f"trainer.output_dir={out}", "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming rl from" in resumed.stdout
    # The kill left the run's lock behind: taken over, since its process is gone.
    assert f"took over the lock of a run that ended without releasing it (pid {proc.pid} on host" in resumed.stdout
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [(r["phase"], r.get("step"), r.get("tag")) for r in records] == \
        [(r["phase"], r.get("step"), r.get("tag")) for r in reference]
    assert _comparable(records) == _comparable(reference)
    sft_steps = [int(o.split("=")[1]) for o in overrides if o.startswith("trainer.sft_steps=")][-1]
    assert json.loads((out / "sft_model" / "polyfsdp_state.json").read_text())["global_step"] == sft_steps


def test_output_dir_that_cannot_be_created_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = main([*TINY, f"trainer.output_dir={blocker / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"polyfsdp-train: error: trainer.output_dir: cannot create {blocker / 'run'}"), err[0]


def test_resume_from_an_incomplete_checkpoint_is_a_one_line_error(tmp_path, capsys):
    from omegaconf import OmegaConf

    from polyfsdp.trainer.config.job import load_config

    step = tmp_path / "old" / "checkpoints" / "sft" / "step_000001"
    step.mkdir(parents=True)  # e.g. a save that was killed halfway
    # The run it belongs to wrote its config.yaml (without one the run is refused unchecked).
    OmegaConf.save(OmegaConf.create(load_config(TINY).raw), tmp_path / "old" / "config.yaml")
    code = main([*TINY, f"trainer.output_dir={tmp_path / 'new'}", f"trainer.resume={step}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"polyfsdp-train: error: trainer.resume: cannot load {step}: "), err[0]


@pytest.mark.parametrize("override,suggestion", [
    ("algo.actor.lr=1e-3", "did you mean algo.actor.optim.lr?"),  # the same leaf, one section down
    ("trainer.rl_stepz=3", "did you mean trainer.rl_steps?"),  # a misspelling
])
def test_an_unknown_key_suggests_the_key_that_was_meant(override, suggestion, capsys):
    from polyfsdp.trainer.train import main

    assert main([override]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"polyfsdp-train: error: {override.split('=')[0]}: unknown key; "
                                              f"{suggestion}"), err
