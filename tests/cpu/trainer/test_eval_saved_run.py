"""``polyfsdp-eval RUN/final`` on a run directory that is not the user's (shared, downloaded): its
config.yaml is data. Code it names (``reward.fn``, ``rollout.env``, ``algo.adv_estimator``,
``algo.actor.policy_loss`` as FILE.py:NAME) is not imported unless the user names it on the command
line or passes --trust-run-code, and its ``${oc.env:...}`` interpolations are not resolved.

Each crafted directory is a real run's (config.yaml, metrics.jsonl, final/) with one key changed;
the payloads are a file created on import and an environment variable standing for a secret."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml
from omegaconf import OmegaConf

from polyfsdp.trainer.eval_cli import main as eval_main
from polyfsdp.trainer.train import main as train_main

SECRET_VARIABLE, SECRET = "POLYFSDP_TEST_SECRET", "s3cret-token-of-the-reader"
# What each code key's file must define for its import to be attempted; creating the marker is the payload.
USER_CODE_KEYS = {"reward.fn": "score", "rollout.env": "Env", "algo.adv_estimator": "estimate",
                  "algo.actor.policy_loss": "loss"}


@pytest.fixture(scope="module")
def genuine_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved_run") / "run"
    assert train_main(["trainer.sft_steps=1", "trainer.rl_steps=0", "trainer.sft_batch_size=4", "data.eval_size=4",
                       "trainer.progress=off", "trainer.plot=false", f"trainer.output_dir={out}"]) == 0
    return out


def crafted_run(genuine, where, key: str, value: str):
    """A copy of ``genuine``'s config.yaml, metrics.jsonl and final/ in ``where``, with ``key`` set to ``value``."""
    run = where / "downloaded_run"
    run.mkdir()
    shutil.copy(genuine / "metrics.jsonl", run)
    shutil.copytree(genuine / "final", run / "final")
    config = yaml.safe_load((genuine / "config.yaml").read_text())
    *sections, leaf = key.split(".")
    node = config
    for section in sections:
        node = node[section]
    node[leaf] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def code_file(where, marker) -> str:
    """A Python file that creates ``marker`` when imported (and defines every name USER_CODE_KEYS uses)."""
    path = where / "authors_code.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\n"
                    "def score(*args, **kwargs):\n    return 0.0\n"
                    "estimate = loss = score\n"
                    "class Env:\n    def reset(self, example):\n        return []\n"
                    "    def step(self, text):\n        return None\n")
    return str(path)


@pytest.mark.parametrize("key", list(USER_CODE_KEYS))
def test_code_a_saved_config_names_is_not_imported(genuine_run, tmp_path, capsys, key):
    marker = tmp_path / "imported"
    spec = f"{code_file(tmp_path, marker)}:{USER_CODE_KEYS[key]}"
    run = crafted_run(genuine_run, tmp_path, key, spec)
    status = eval_main([str(run / "final")])
    assert not marker.exists()
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and err.startswith("polyfsdp-eval: error: "), err
    assert f"names code to import ({key}={spec})" in err and "--trust-run-code" in err, err
    # Negative control: the same directory with the flag that trusts it imports the author's code.
    eval_main([str(run / "final"), "--trust-run-code"])
    assert marker.exists()


def test_code_named_on_the_command_line_is_the_users_own(genuine_run, tmp_path):
    marker = tmp_path / "imported"
    spec = f"{code_file(tmp_path, marker)}:score"
    run = crafted_run(genuine_run, tmp_path, "reward.fn", spec)
    assert eval_main([str(run / "final"), f"reward.fn={spec}"]) == 0
    assert marker.exists()
    assert json.loads((run / "eval" / "final.json").read_text())["metrics"]["reward"] == 0.0  # its score ran


def test_a_saved_interpolation_stays_a_literal_string(genuine_run, tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_VARIABLE, SECRET)
    interpolation = "${oc.env:" + SECRET_VARIABLE + "}"
    run = crafted_run(genuine_run, tmp_path, "data.prompt_key", interpolation)  # unused by the built-in task
    # Negative control: plain OmegaConf resolves the saved file into the reader's secret.
    assert OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)["data"]["prompt_key"] == SECRET
    assert eval_main([str(run / "final")]) == 0
    written = (run / "eval" / "final.json").read_text()
    assert SECRET not in written
    assert json.loads(written)["data"]["prompt_key"] == interpolation


def test_a_saved_config_with_yaml_aliases_is_refused_in_one_line(genuine_run, tmp_path, capsys):
    run = crafted_run(genuine_run, tmp_path, "data.prompt_key", "prompt")
    # Each level repeats the one before ten times: 10^n nodes once OmegaConf copies them (n=9 never
    # finishes); three levels keep the unfixed reader quick, refused by its unknown key instead.
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{new}: &{new} [{', '.join([f'*{old}'] * 10)}]\n" for old, new in zip("ab", "bc"))
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + laughs)
    assert eval_main([str(run / "final")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "uses a YAML alias" in err and str(run / "config.yaml") in err, err


@pytest.mark.parametrize("what", ["fifo", "oversized", "link"])
def test_a_saved_config_that_could_not_be_written_by_a_run_is_refused(tmp_path, what):
    import os

    from polyfsdp.trainer.config.saved_run import MAX_SAVED_CONFIG_BYTES, read_saved_yaml
    from polyfsdp.trainer.errors import ConfigError

    config = tmp_path / "config.yaml"
    if what == "fifo":  # reading one blocks until a writer comes: forever
        os.mkfifo(config)
    elif what == "oversized":
        config.write_text("trainer:\n  note: " + "x" * MAX_SAVED_CONFIG_BYTES + "\n")
    else:  # a valid config of the reader's own, which the results would copy
        users = tmp_path / "users_config.yaml"
        users.write_text("data:\n  train_files: [/home/user/private.jsonl]\n")
        config.symlink_to(users)
    refusal = {"fifo": "not a regular file", "oversized": "over the", "link": "a symbolic link"}[what]
    with pytest.raises(ConfigError, match=refusal):
        read_saved_yaml(config)


@pytest.mark.parametrize("link", ["eval", "eval/final.json"])
def test_results_are_never_written_through_a_link_in_the_run(genuine_run, tmp_path, capsys, link):
    run = crafted_run(genuine_run, tmp_path, "data.prompt_key", "prompt")
    users = tmp_path / "users_files"  # the payload: a file created there, outside the run
    users.mkdir()
    if link == "eval":
        (run / "eval").symlink_to(users)
    else:
        (run / "eval").mkdir()
        (run / "eval" / "final.json").symlink_to(users / "created_by_the_run")  # dangling: exists() is False
    assert eval_main([str(run / "final")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"polyfsdp-eval: error: {run / link}: a symbolic link (to "), err
    assert list(users.iterdir()) == []
    # The user's own --json FILE is theirs to aim anywhere.
    assert eval_main([str(run / "final"), "--json", str(users / "mine.json")]) == 0


def test_an_override_of_the_section_around_a_code_key_leaves_the_saved_code_refused(genuine_run, tmp_path, capsys):
    """``algo.actor={epochs: 1}`` sets no policy loss: merged into the saved section, the run's
    own ``algo.actor.policy_loss`` stays, and is still the run's code, not the user's."""
    marker = tmp_path / "imported"
    spec = f"{code_file(tmp_path, marker)}:loss"
    run = crafted_run(genuine_run, tmp_path, "algo.actor.policy_loss", spec)
    status = eval_main([str(run / "final"), "algo.actor={epochs: 1}"])
    assert not marker.exists()
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and f"names code to import (algo.actor.policy_loss={spec})" in err, err


def test_a_latest_naming_a_directory_outside_the_run_is_one_line(genuine_run, tmp_path, capsys):
    run = tmp_path / "downloaded_run"
    shutil.copytree(genuine_run, run)
    pointer = run / "checkpoints" / "sft" / "latest"
    pointer.write_text("../../../elsewhere\n")
    assert eval_main([str(run / "checkpoints" / "sft")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"polyfsdp-eval: error: MODEL_DIR {str(run / 'checkpoints' / 'sft')!r}: "
                                              f"{pointer}: names '../../../elsewhere', which is not"), err
