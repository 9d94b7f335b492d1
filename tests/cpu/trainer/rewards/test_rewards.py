"""reward.fn: finding the function (built-in, file, module) and checking what it returns."""
from __future__ import annotations

import math
import re
import sys

import pytest

from polyfsdp.trainer.errors import ConfigError, RewardError
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.rewards.reward_fn import Scorer, build_scorer, load_reward_fn, mean_over_ranks
from polyfsdp.trainer.rewards.rules import gsm8k
from polyfsdp.trainer.data.example import Example

USER_REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str),
            "eos_seen": float(2 in extra_info["response_ids"]), "note": "not a number"}

def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("no checker for " + data_source)

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

not_a_function = 3
'''

EXAMPLE = Example(prompt="2+2=", answer="4", data_source="toy", extra_info={"index": 7}, where="train.jsonl line 3")


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_builtin_file_and_module_paths_all_resolve(reward_file, tmp_path, monkeypatch):
    assert load_reward_fn("gsm8k") is gsm8k
    assert load_reward_fn(f"{reward_file}:compute_score").__name__ == "compute_score"
    assert load_reward_fn("polyfsdp.trainer.rewards.rules:math_boxed").__name__ == "math_boxed"
    package = tmp_path / "pkg_rewards_12"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rules.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_reward_fn("pkg_rewards_12.rules:boom").__name__ == "boom"
    finally:
        sys.modules.pop("pkg_rewards_12.rules", None)
        sys.modules.pop("pkg_rewards_12", None)


@pytest.mark.parametrize("spec,expected", [
    ("missing_file.py:f", "reward.fn=missing_file.py:f: no such file 'missing_file.py' in the working directory "),
    ("no_such_module_12:f", "reward.fn=no_such_module_12:f: cannot import module 'no_such_module_12'"),
    ("polyfsdp.trainer.rewards.rules:nope", "reward.fn=polyfsdp.trainer.rewards.rules:nope: "
                                           "polyfsdp.trainer.rewards.rules has no function 'nope'"),
    ("{file}:not_a_function", "is not callable"),
    ("{file}:", "expected a built-in"),
])
def test_a_missing_file_module_or_function_is_a_one_line_config_error(spec, expected, reward_file):
    with pytest.raises(ConfigError) as info:
        load_reward_fn(spec.format(file=reward_file))
    assert "\n" not in str(info.value) and expected in str(info.value), str(info.value)


def test_unknown_builtin_name_is_refused_by_the_config():
    with pytest.raises(ConfigError, match=r"^reward.fn: got 'gsm9k'; expected auto, none \(a reward model alone\), "
                                          r"a built-in \(char_match"):
        load_config(["reward.fn=gsm9k"])
    with pytest.raises(ConfigError, match=r"reward.kwargs: keys must be Python identifiers"):
        load_config(["reward.kwargs={1: 2}"])


def test_auto_picks_the_datas_rule_and_kwargs_reach_the_function(reward_file):
    assert build_scorer(load_config([]).reward, load_config([]).data).name == "char_match"
    cfg = load_config(["data=arith_words"])
    assert build_scorer(cfg.reward, cfg.data).name == "gsm8k"
    cfg = load_config([f"reward.fn={reward_file}:compute_score", "reward.kwargs={bonus:0.5}"])
    scorer = build_scorer(cfg.reward, cfg.data)
    value, extras = scorer.score(EXAMPLE, "4", [5, 2])
    assert value == 1.5
    # Numeric keys become metrics; the text one is ignored; token ids arrive in extra_info.
    assert extras == {"length": 1.0, "eos_seen": 1.0}


def test_dict_metrics_are_averaged_over_what_was_reported(reward_file):
    scorer = Scorer(load_reward_fn(f"{reward_file}:compute_score"), "f")
    rewards, extras = scorer.score_all([EXAMPLE], ["4", "44", "x"], [[2], [1], [2]], group=3)
    assert rewards == [1.0, 0.0, 0.0]
    assert mean_over_ranks(extras) == {"reward/eos_seen": pytest.approx(2 / 3), "reward/length": 4 / 3}


@pytest.mark.parametrize("name,expected", [
    ("boom", "reward.fn=F:boom raised KeyError: 'no checker for toy' at {reward_file}:{boom_line} (record train.jsonl "
             "line 3, completion '4')"),
    ("nan", "reward.fn=F:nan returned nan for record train.jsonl line 3; expected a finite number"),
    ("text", "reward.fn=F:text returned '1.0' for record train.jsonl line 3; expected a finite number"),
    ("no_score", "reward.fn=F:no_score returned a dict without 'score' (keys ['acc']) for record train.jsonl line 3"),
])
def test_a_failing_reward_stops_with_one_line_naming_function_record_and_value(name, expected, reward_file):
    scorer = Scorer(load_reward_fn(f"{reward_file}:{name}"), f"F:{name}")
    with pytest.raises(RewardError) as info:
        scorer.score(EXAMPLE, "4", [2])
    boom_line = next(i for i, line in enumerate(open(reward_file).read().splitlines(), 1) if "raise KeyError" in line)
    expected = expected.format(reward_file=reward_file, boom_line=boom_line)
    assert "\n" not in str(info.value) and str(info.value).startswith(expected), str(info.value)


def test_infinite_and_boolean_results():
    def inf(*args):
        return math.inf

    with pytest.raises(RewardError, match="returned inf"):
        Scorer(inf, "inf").score(EXAMPLE, "4", [])
    assert Scorer(lambda *a: True, "b").score(EXAMPLE, "4", []) == (1.0, {})


def test_a_reward_file_may_import_its_neighbour_inside_the_function(tmp_path, monkeypatch):
    # A lazy import runs at call time, after loading: the file's directory must still be importable.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "qa_neighbour_grader", raising=False)
    (tmp_path / "qa_neighbour_grader.py").write_text("def grade(a, b):\n    return float(a == b)\n")
    (tmp_path / "lazy.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                      "    from qa_neighbour_grader import grade\n"
                                      "    return grade(solution_str, ground_truth)\n")
    scorer = Scorer(load_reward_fn(f"{tmp_path / 'lazy.py'}:compute_score"), "lazy")
    assert scorer.score(EXAMPLE, "4", [2]) == (1.0, {})


@pytest.mark.parametrize("source,kwargs,expected", [
    ("def f(data_source, solution_str, ground_truth):\n    return 1.0\n", None,
     r"^reward.fn=F: f\(data_source, solution_str, ground_truth\) cannot be called as fn\(data_source, "
     r"solution_str, ground_truth, extra_info\) \(too many positional arguments\); give it verl's signature"),
    ("def f(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n", "{scale:2}",
     r"cannot be called as fn\(data_source, solution_str, ground_truth, extra_info, scale=...\) "
     r"\(got an unexpected keyword argument 'scale'\)"),
])
def test_a_reward_that_cannot_take_the_arguments_is_refused_before_any_model(tmp_path, source, kwargs, expected):
    # Found when the scorer is built (the job does so first), not at the first evaluation.
    (tmp_path / "r.py").write_text(source)
    cfg = load_config([f"reward.fn={tmp_path / 'r.py'}:f"] + ([f"reward.kwargs={kwargs}"] if kwargs else []))
    with pytest.raises(ConfigError, match=expected.replace("F", re.escape(f"{tmp_path / 'r.py'}:f"), 1)) as info:
        build_scorer(cfg.reward, cfg.data)
    assert "\n" not in str(info.value)


def _spin(*args, **kwargs):
    while True:
        pass


def _spin_swallowing_exceptions(*args, **kwargs):
    while True:
        try:
            _spin()
        except Exception:  # a reward's catch-all must not swallow the timeout
            pass


@pytest.mark.parametrize("fn", [_spin, _spin_swallowing_exceptions], ids=["loop", "loop_catching_exception"])
def test_a_reward_call_longer_than_its_timeout_is_one_line_naming_record_and_key(fn):
    scorer = Scorer(fn, "F:spin", timeout_s=0.2)
    with pytest.raises(RewardError) as info:
        scorer.score(EXAMPLE, "4", [2])
    assert str(info.value) == ("reward.fn=F:spin took longer than reward.timeout_s=0.2 s (record train.jsonl line 3, "
                               "completion '4'); make it faster or raise reward.timeout_s")
    # The scorer keeps working after a timeout, and a fast call is never interrupted.
    scorer.fn = lambda *args: 0.5
    assert [scorer.score(EXAMPLE, "4", [2])[0] for _ in range(200)] == [0.5] * 200


def test_the_timeout_is_a_documented_config_key():
    assert load_config([]).reward.timeout_s == 60
    assert load_config(["reward.timeout_s=null"]).reward.timeout_s is None
    assert build_scorer(load_config(["reward.timeout_s=2.5"]).reward, load_config([]).data).timeout_s == 2.5


STUCK_IN_C = """
import time
from polyfsdp.trainer.rewards.timeout import CallDeadline
from polyfsdp.trainer.rewards.reward_fn import Scorer
from polyfsdp.trainer.data.example import Example
scorer = Scorer(lambda *a: time.sleep(3600), "F:sleep", timeout_s=0.2)
scorer._deadline = CallDeadline(0.2, grace_s=0.3)
scorer.score(Example(prompt="p", answer="a", where="data.jsonl line 5"), "x", [1])
"""


def test_a_reward_stuck_in_c_code_ends_the_process_with_one_line():
    import subprocess

    proc = subprocess.run([sys.executable, "-c", STUCK_IN_C], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("polyfsdp-train: error: reward.fn=F:sleep did not return within reward.timeout_s="
                                   "0.2 s (nor 0.3 s later) (record data.jsonl line 5, completion 'x'); stopping this process")


@pytest.mark.parametrize("value,shown", [(10**400, "1000000000"), (1e308, "1e+308"), (-1e10, "-10000000000.0"),
                                         ({"score": 10**400}, "1000000000")])
def test_an_overflowing_reward_is_one_line_naming_the_record(value, shown):
    with pytest.raises(RewardError) as info:
        Scorer(lambda *args: value, "F:big").score(EXAMPLE, "4", [])
    message = str(info.value)
    assert message.startswith(f"reward.fn=F:big returned {shown}") and "for record train.jsonl line 3" in message
    assert "\n" not in message and len(message) < 250, message


def test_overflowing_extra_metrics_are_dropped_like_non_finite_ones():
    assert Scorer(lambda *args: {"score": 1, "huge": 10**400, "ok": 2}, "F").score(EXAMPLE, "4", []) == \
        (1.0, {"ok": 2.0})


@pytest.mark.parametrize("code", [0, 1, None])
def test_a_reward_calling_sys_exit_is_an_error_not_the_end_of_the_run(code):
    def leave(*args):
        sys.exit(code)

    with pytest.raises(RewardError, match=rf"^reward.fn=F:exit called sys.exit\({code!r}\) \(record train.jsonl line 3"):
        Scorer(leave, "F:exit").score(EXAMPLE, "4", [])


def test_nested_extra_info_changed_by_a_reward_does_not_reach_the_next_call():
    example = Example(prompt="p", answer="a", extra_info={"meta": {"seen": []}, "tags": ["x"]})
    seen = []

    def mutate(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(len(extra_info["meta"]["seen"]) + len(extra_info["tags"]))
        extra_info["meta"]["seen"].append(solution_str)
        extra_info["tags"].append("y")
        return 0.0

    scorer = Scorer(mutate, "F:mutate")
    for text in ("a", "b", "c"):
        scorer.score(example, text, [])
    assert seen == [1, 1, 1]
    assert example.extra_info == {"meta": {"seen": []}, "tags": ["x"]}


def test_a_raising_reward_names_the_users_file_and_line(tmp_path, monkeypatch, capsys):
    from polyfsdp.trainer.rewards.reward_fn import load_reward_fn

    path = tmp_path / "my_reward.py"
    path.write_text("def helper(x):\n    return 1 / x\n\n\ndef score(data_source, solution_str, ground_truth, "
                    "extra_info=None):\n    return helper(0)\n")
    scorer = Scorer(load_reward_fn(f"{path}:score"), "my_reward.py:score")
    with pytest.raises(RewardError) as info:
        scorer.score(EXAMPLE, "4", [2])
    assert f"raised ZeroDivisionError: division by zero at {path}:2 (record " in str(info.value), str(info.value)
    assert capsys.readouterr().err == ""
    # The documented switch prints the whole traceback before the one line.
    monkeypatch.setenv("POLYFSDP_TRACEBACK", "1")
    with pytest.raises(RewardError):
        scorer.score(EXAMPLE, "4", [2])
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "return helper(0)" in err
