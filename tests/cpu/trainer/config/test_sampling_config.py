"""Issue 42's new keys (items 4, 6, 7): the sampling controls of ``algo.actor`` and ``eval``,
``eval.initial`` and ``trainer.log_rollout_samples``: composed defaults equal the dataclasses',
bad values are one line naming the key, and a short job logs each RL step's rollout samples
and skips the initial evaluation when asked."""
import dataclasses
import json

import pytest

from polyfsdp.trainer.config.algo import ActorSection
from polyfsdp.trainer.config.composition import compose, to_container
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.sampling import SamplingControls
from polyfsdp.trainer.config.sections import EvalSection, TrainerSection
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main

CONTROLS = [f.name for f in dataclasses.fields(SamplingControls)]


def _default(cls, name):
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def test_composed_defaults_equal_the_dataclasses():
    raw = to_container(compose([]))
    actor, evaluation, trainer = raw["algo"]["actor"], raw["eval"], raw["trainer"]
    for name in CONTROLS:
        assert actor[name] == _default(ActorSection, name), name
        assert evaluation[name] == _default(EvalSection, name), name
    assert evaluation["initial"] is _default(EvalSection, "initial") is True
    assert trainer["log_rollout_samples"] == _default(TrainerSection, "log_rollout_samples") == 0


@pytest.mark.parametrize("override,expected", [
    ("algo.actor.top_p=0", "algo.actor.top_p: expected a number in (0, 1]"),
    ("algo.actor.top_p=1.5", "algo.actor.top_p: expected a number in (0, 1]"),
    ("algo.actor.top_k=-2", "algo.actor.top_k: expected an int >= 1, or 0 / -1 (off), got -2"),
    ("algo.actor.repetition_penalty=0", "algo.actor.repetition_penalty: expected > 0"),
    ("algo.actor.stop=[a,'']", "algo.actor.stop: expected a list of non-empty strings"),
    ("eval.top_p=-0.1", "eval.top_p: expected a number in (0, 1]"),
    ("eval.repetition_penalty=-1", "eval.repetition_penalty: expected > 0"),
    ("eval.stop=[1]", "eval.stop: expected a list of non-empty strings"),
    ("eval.initial=sometimes", "eval.initial: expected"),
    ("trainer.log_rollout_samples=-1", "trainer.log_rollout_samples: expected an int >= 0"),
])
def test_bad_values_are_one_line_naming_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert "\n" not in str(info.value) and str(info.value).startswith(expected), str(info.value)


def test_good_values_build_and_reach_the_sampling_options():
    cfg = load_config(["algo.actor.top_p=0.9", "algo.actor.top_k=-1", "algo.actor.repetition_penalty=1.1",
                       "algo.actor.stop=[END]", "eval.stop=STOP", "eval.initial=false"])
    assert cfg.algo.actor.sampling_options() == {"top_p": 0.9, "top_k": -1, "repetition_penalty": 1.1,
                                                 "stop": ("END",)}
    assert cfg.eval.sampling_options()["stop"] == ("STOP",) and cfg.eval.initial is False


def test_a_job_logs_rollout_samples_per_rl_step_and_can_skip_the_initial_evaluation(tmp_path):
    out = tmp_path / "run"
    code = main(["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.sft_batch_size=8", "trainer.prompts_per_step=4",
                 "data.eval_size=8", "trainer.progress=lines", "algo.actor.group_size=4", f"trainer.output_dir={out}",
                 "trainer.log_rollout_samples=3", "eval.initial=false", "algo.actor.top_k=20", "algo.actor.top_p=0.95",
                 "algo.actor.repetition_penalty=1.1", "algo.actor.stop=[zz]"])
    assert code == 0
    evals = [r["tag"] for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "eval"]
    assert "initial" not in evals and evals[-1] == "final"
    lines = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    rollout = [line for line in lines if line["tag"] == "rollout"]
    assert [line["global_step"] for line in rollout] == [3, 3, 3, 4, 4, 4]
    assert all(set(line) == {"global_step", "tag", "prompt", "completion", "ground_truth", "reward"}
               for line in rollout)
    assert all("zz" not in line["completion"][:-2] for line in rollout)  # nothing past a stop string


@pytest.mark.parametrize("override,expected", [
    ("data.filter_overlong_prompts=true", "data.filter_overlong_prompts: verl's key; here it is data.overlong=filter"),
    ("+data.truncation=left", "data.truncation: verl's key; here it is data.overlong=error"),
])
def test_verls_prompt_length_keys_name_ours(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(["data=jsonl", "data.path=x.jsonl", override])
    assert "\n" not in str(info.value) and str(info.value).startswith(expected), str(info.value)
