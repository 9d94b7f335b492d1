"""Where a run was started: the directory its config.yaml's relative paths were read from.

polyfsdp-train reads a relative ``data.train_files=[train.jsonl]`` (or ``reward.fn=my_reward.py:score``)
from its working directory, and config.yaml keeps the path as typed. :func:`save_run_config` writes
config.yaml together with :data:`START_DIR_FILE` (rank 0's working directory) at every start, so the
two always describe the same start: a resumed run records where it was resumed, the directory the
paths of the config.yaml it rewrote were read from then.

polyfsdp-eval (:func:`resolve_saved_paths`) reads the saved config's relative paths from that
directory instead of its own. The run directory may be someone else's (saved_run.py), so the record
is only a base for paths the saved config could as well name absolutely: it imports nothing, and a
code key's ``FILE.py`` is resolved against it only when the user trusts the run's code.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Callable

from .plugins import names_code, names_file
from .saved_run import USER_CODE_KEYS, dotted_value

START_DIR_FILE = "started_in.json"
# Keys whose saved value is a file or directory (or a list of files) the job reads: the data, the
# run's starting model (a checkpoint's phase may start from it) and a PPO run's saved value head.
SAVED_PATH_KEYS = ("data.path", "data.train_files", "data.val_files", "model.path", "algo.critic.value_head_path")


def save_run_config(out: Path, raw: dict) -> None:
    """Write ``out``/config.yaml (``raw``) and ``out``/:data:`START_DIR_FILE` (this process's
    working directory), creating ``out``."""
    from omegaconf import OmegaConf

    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(raw), out / "config.yaml")
    (out / START_DIR_FILE).write_text(json.dumps({"working_directory": os.getcwd()}) + "\n")


def recorded_start_dir(run_dir: Path) -> tuple[Path | None, str]:
    """``(directory, "")``: where the run in ``run_dir`` was started, an existing directory on this
    machine; else ``(None, why not)`` (an older run without the record, a downloaded run whose
    directory is not here, a record that is not one)."""
    record = run_dir / START_DIR_FILE
    if not record.is_file():
        return None, f"{run_dir} records no start directory (no {START_DIR_FILE}: a run from before it was written)"
    try:
        recorded = json.loads(record.read_text()).get("working_directory")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if not isinstance(recorded, str) or not os.path.isabs(recorded):
        return None, f"{record} holds no absolute working_directory"
    if not os.path.isdir(recorded):
        return None, f"the run was started in {recorded}, which is not a directory on this machine"
    return Path(recorded), ""


def _relative(path) -> bool:
    return isinstance(path, str) and bool(path) and not os.path.isabs(path)


def _code_file(spec) -> str | None:
    """The relative ``FILE.py`` a code key's ``FILE.py:NAME`` imports, else None (a module, a built-in)."""
    if not names_code(spec):
        return None
    target = spec.rpartition(":")[0]
    return target if names_file(target) and _relative(target) else None


def _relative_keys(raw: dict, trust_code: bool, given: list[str]) -> list[str]:
    """The keys of ``raw`` holding a relative path to resolve, but those the user gives (``given``:
    the override keys, a group such as ``data`` counting for its keys), whose saved value is replaced."""
    found = []
    for key in SAVED_PATH_KEYS:
        value = dotted_value(raw, key)
        if any(_relative(v) for v in (value if isinstance(value, list) else [value])):
            found.append(key)
    found += [key for key in USER_CODE_KEYS if trust_code and _code_file(dotted_value(raw, key))]
    return [key for key in found if not any(key == k or key.startswith(k + ".") for k in given)]


def _resolved(key: str, value, base: Path):
    if key in USER_CODE_KEYS:
        target, _, name = value.rpartition(":")
        return f"{base / target}:{name}" if _code_file(value) else value
    if isinstance(value, list):
        return [str(base / v) if _relative(v) else v for v in value]
    return str(base / value) if _relative(value) else value


def resolve_saved_paths(raw: dict, run_dir: Path, given: list[str], trust_code: bool,
                        say: Callable[[str], None]) -> dict:
    """``raw`` (``run_dir``'s saved config, before the user's overrides) with the relative paths of
    :data:`SAVED_PATH_KEYS`, and with ``trust_code`` the relative ``FILE.py`` of the code keys,
    joined to the directory the run was started in; ``given``: the keys of the user's overrides,
    left alone. When that directory is not known here, ``raw`` as it is (its paths read from the
    working directory) and one line through ``say`` naming the keys concerned."""
    keys = _relative_keys(raw, trust_code, given)
    if not keys:
        return raw
    base, why_not = recorded_start_dir(run_dir)
    if base is None:
        say(f"polyfsdp-eval: {why_not}: the relative paths of its config.yaml ({', '.join(keys)}) are read "
            f"from the working directory {os.getcwd()}")
        return raw
    raw = copy.deepcopy(raw)
    for key in keys:
        *sections, leaf = key.split(".")
        dotted_value(raw, ".".join(sections))[leaf] = _resolved(key, dotted_value(raw, key), base)
    return raw
