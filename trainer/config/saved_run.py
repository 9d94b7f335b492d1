"""A run's saved ``config.yaml``, read as data: ``polyfsdp-eval RUN/final`` evaluates run directories
that may be someone else's (shared, downloaded), so nothing in one runs on the reader's machine.

- :func:`read_saved_yaml`: the file as a plain dict, refused in one line when it could not be a
  config polyfsdp-train wrote: a symbolic link (to a file of the reader's, whose sections the
  results would copy), over :data:`MAX_SAVED_CONFIG_BYTES`, not a regular file, or using
  YAML aliases (``*name``; ten nested aliases of ten items each expand to 10^10 nodes when
  OmegaConf copies them, hanging the reader; polyfsdp-train never writes one).
- :func:`load_saved_config`: the YAML as a plain dict. Interpolations (``${oc.env:TOKEN}``,
  ``${oc.decode:...}``, any resolver) stay the literal strings they are: polyfsdp-train saves
  its config resolved, so a ``${`` in one was put there by hand, and resolving it would copy the
  reader's environment (a secret token) into the results.
- :func:`parse_overrides`, :func:`apply_overrides`: the user's ``KEY=VALUE`` overrides on top,
  resolved on their own (they are the user's; the saved values they sit beside are not).
- :func:`refuse_saved_code`: a key naming code to import (``reward.fn=FILE.py:NAME`` ...) that
  comes from the saved config, not the command line, is one ConfigError unless the user passed
  :data:`TRUST_FLAG`.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .composition import upgrade_saved_config
from .plugins import names_code

# Every key whose value plugins.py imports (trainer/rewards/reward_fn.py, trainer/rollout/
# environments.py, trainer/algos/estimators.py, trainer/algos/policy_losses.py).
USER_CODE_KEYS = ("reward.fn", "rollout.env", "rollout.agent", "algo.adv_estimator", "algo.actor.policy_loss")
TRUST_FLAG = "--trust-run-code"
# A config.yaml polyfsdp-train writes is a few KiB: far beyond that, it is not one.
MAX_SAVED_CONFIG_BYTES = 1 << 20


def read_saved_yaml(path: Path) -> dict | list | str | None:
    """``path`` (a run's config.yaml, which may be crafted) parsed, nothing resolved; ConfigError
    when it is a symbolic link, not a regular file of at most MAX_SAVED_CONFIG_BYTES, uses a YAML
    alias or does not parse."""
    import io
    import stat

    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if path.is_symlink():  # read as the run's, a link's target (a file of the reader's) would end up in its results
        raise ConfigError(f"{path}: a symbolic link (to {os.readlink(path)}); refused: a run's configuration is "
                          f"read only from its own directory")
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device (/dev/zero) would never end reading
            raise ConfigError(f"{path}: not a regular file; refused as the run's configuration")
        with open(path, "rb") as f:
            data = f.read(MAX_SAVED_CONFIG_BYTES + 1)
        if len(data) > MAX_SAVED_CONFIG_BYTES:
            raise ConfigError(f"{path}: over the {MAX_SAVED_CONFIG_BYTES} bytes a run's config.yaml could hold; "
                              f"refused")
        text = data.decode()
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise ConfigError(f"{path}: uses a YAML alias (*name), which polyfsdp-train never writes; refused "
                              f"(nested aliases expand exponentially when read)")
        return OmegaConf.to_container(OmegaConf.load(io.StringIO(text)), resolve=False)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{path}: cannot read it as the run's configuration: {exc}") from None


def load_saved_config(path: Path) -> dict:
    """``path`` (a run's config.yaml) as a plain dict, nothing resolved, the renamed keys under
    their new names; a file that is not a YAML mapping is one ConfigError."""
    raw = read_saved_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config groups, got {type(raw).__name__}")
    return upgrade_saved_config(raw)


def _merged(base, update):
    if isinstance(base, dict) and isinstance(update, dict):
        return {**base, **{key: _merged(base.get(key), value) for key, value in update.items()}}
    return update


def parse_overrides(keys: list[str]) -> dict:
    """The ``KEY=VALUE`` overrides ``keys`` as a nested mapping, only their own interpolations resolved."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(keys), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(" ".join(str(exc).split())) from None


def apply_overrides(raw: dict, given: dict) -> dict:
    """``raw`` with the user's overrides ``given`` (:func:`parse_overrides`) merged in (a mapping
    into a mapping, any other value replacing)."""
    return _merged(raw, given)


def dotted_value(raw: dict, dotted: str):
    """``raw["a"]["b"]`` for ``"a.b"``; None where a part is missing or not a mapping."""
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def refuse_saved_code(raw: dict, given: dict, saved: Path, trusted: bool) -> None:
    """One ConfigError naming every key of :data:`USER_CODE_KEYS` whose value in ``raw`` would
    import code and is not the value the command line gave it (``given``: the overrides as a
    mapping, a group composed from the command line included), unless ``trusted``. ``saved``: the
    config it came from. The value, not the key: ``algo.actor={epochs: 1}`` names no policy loss,
    and the saved one merged beside it is still the run's."""
    if trusted:
        return
    named = [f"{key}={dotted_value(raw, key)}" for key in USER_CODE_KEYS if names_code(dotted_value(raw, key))
             and dotted_value(given, key) != dotted_value(raw, key)]
    if named:
        raise ConfigError(f"{saved} names code to import ({', '.join(named)}): polyfsdp-eval does not run code from "
                          f"a run directory's config, which may not be yours; pass the key on the command line to use "
                          f"your own, or {TRUST_FLAG} if you trust this run")
