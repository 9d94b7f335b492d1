"""The docs' examples run as written (the engine from Python, own data, multi-turn), and the config keys
they name exist."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.helpers import ROOT

DOCS = ROOT / "docs"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_python_api_engine_example_runs():
    blocks = _python_blocks((DOCS / "python-api.md").read_text())
    assert len(blocks) == 1, "expected exactly one python example in docs/python-api.md"
    result = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300,
                            env={"POLYFSDP_BACKEND": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    # It printed torch.fx's is_fx_tracing deprecation warning (torch's jagged constructor calls it).
    assert result.stderr.strip() == "", result.stderr[-3000:]
    for key in ("'loss'", "'grad_norm'", "'step_skipped'", "'clip_frac'"):
        assert key in result.stdout


def test_patch_keys_the_docs_name_exist_in_the_patches_config():
    page = (DOCS / "backends-and-patches.md").read_text()
    from polyfsdp.trainer.config.composition import compose, to_container

    config = to_container(compose(["trainer.output_dir=x"]))["patches"]  # declared in patches/toggles.py
    keys = set(re.findall(r"`patches\.(\w+)", page))
    assert keys, "docs/backends-and-patches.md names no patches.* key"
    for key in keys:
        assert key in config, key


def _own_data_section() -> str:
    """docs/data.md: the whole page is the own-data section."""
    text = (DOCS / "data.md").read_text()
    assert text.startswith("# Train on your own data\n"), "docs/data.md is no longer the own-data page"
    return text


def test_own_data_example_runs_as_written(tmp_path):
    # The section's files (```LANG NAME blocks) and its first command, on a tiny BPE chat
    # model saved as my_model/, with few steps: the command must work exactly as shown.
    import shlex

    from tests.helpers.own_data_cases import write_model_dir

    section = _own_data_section()
    files = dict((name, body) for name, body in re.findall(r"```\w+ (\S+)\n(.*?)```", section, flags=re.S))
    assert set(files) == {"train.jsonl", "val.jsonl", "my_reward.py"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    write_model_dir(tmp_path / "my_model")
    command = shlex.split(re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].replace("\\\n", " "))
    assert command[0] == "polyfsdp-train"
    tiny = ["trainer.rl_steps=2", "trainer.prompts_per_step=2", "algo.actor.group_size=2", "trainer.progress=off",
            "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0", "trainer.output_dir=out"]
    result = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *command[1:], *tiny], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "POLYFSDP_BACKEND": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["phase"] == "rl"]
    assert len(grpo) == 2 and all("reward/answered" in r and r["reward/response_tokens"] >= 1 for r in grpo)


def test_own_data_keys_exist_in_the_configs():
    section = _own_data_section()
    # The keys are declared in the sections; data=files composes every one of them.
    from polyfsdp.trainer.config.composition import compose, to_container

    raw = to_container(compose(["data=files", "data.train_files=[a.jsonl]", "trainer.output_dir=x"]))
    for group, key in set(re.findall(r"`(data|reward)\.(\w+)", section)):
        assert key in raw[group], f"{group}.{key}"


def test_multi_turn_example_runs_as_written(tmp_path):
    # The multi-turn page's environment file and its first command, with few steps.
    import shlex

    section = (DOCS / "multi-turn.md").read_text()
    files = dict(re.findall(r"```python (\S+)\n(.*?)```", section, flags=re.S))
    assert set(files) == {"my_env.py", "my_agent.py"}  # my_agent.py: tests/cpu/trainer/rollout/test_agent_endpoint.py
    (tmp_path / "my_env.py").write_text(files["my_env.py"])
    command = shlex.split(re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].replace("\\\n", " "))
    assert command[0] == "polyfsdp-train"
    tiny = ["trainer.sft_steps=2", "trainer.rl_steps=2", "trainer.prompts_per_step=2", "algo.actor.group_size=2",
            "trainer.sft_batch_size=4", "data.eval_size=4", "trainer.progress=off", "trainer.plot=false",
            "trainer.export=false", "trainer.checkpoint_interval=0", "trainer.output_dir=out"]
    result = subprocess.run([sys.executable, "-m", "polyfsdp.trainer.train", *command[1:], *tiny], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "POLYFSDP_BACKEND": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["phase"] == "rl"]
    assert len(grpo) == 2 and all(r["multi_turn/turns_mean"] >= 1.0 for r in grpo)


def test_the_readme_exit_status_table_is_the_code_s():
    """Every ``EXIT_*`` status polyfsdp-train returns (trainer/train.py's own and those it imports
    from trainer/startup.py) is a row of README.md's table, under what it means, and the table
    lists no other status than those, 0 and Python's 1."""
    from polyfsdp.trainer import startup, train

    declared = {name: value for module in (train, startup) for name, value in vars(module).items()
                if name.startswith("EXIT_")}
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", (ROOT / "README.md").read_text(), flags=re.M))
    assert rows, "README.md has no exit status table"
    meaning = {"EXIT_USAGE": "one-line error", "EXIT_INTERRUPTED": "Ctrl-C", "EXIT_TERMINATED": "SIGTERM"}
    assert set(declared) == set(meaning), f"a new EXIT_* constant: say what it means here and in README.md ({declared})"
    for name, status in declared.items():
        assert str(status) in rows, f"README.md's exit status table lacks {status} ({name})"
        assert meaning[name] in rows[str(status)], (name, rows[str(status)])
    assert set(rows) == {"0", "1"} | {str(status) for status in declared.values()}, sorted(rows)
