"""Loading a user's code named in the config: a built-in name, ``path/to/file.py:Name`` or
``package.module:Name`` (``reward.fn``, ``rollout.env``, ``algo.adv_estimator``,
``algo.actor.policy_loss``); every mistake is one ConfigError
naming the key."""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys

from ..errors import ConfigError


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def names_code(spec) -> bool:
    """Whether ``spec`` would import something: only ``TARGET:NAME`` does (:func:`load_object`),
    and no built-in name holds a colon."""
    return isinstance(spec, str) and ":" in spec


def names_file(target: str) -> bool:
    """Whether the ``TARGET`` of ``TARGET:NAME`` is a Python file (imported from its path), not a module."""
    return target.endswith(".py") or os.sep in target or "/" in target


def _load_file(path: str, key: str, spec: str):
    if not os.path.isfile(path):
        # Relative paths are read from where polyfsdp-train was started, not from the data's folder.
        where = "" if os.path.isabs(path) else f" in the working directory {os.getcwd()}"
        raise ConfigError(f"{key}={spec}: no such file {path!r}{where}")
    name = f"polyfsdp_user_{key.replace('.', '_')}_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{key}={spec}: cannot import {path!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    # The file's own directory first, so it can import its neighbours; it stays there because
    # user code often imports them lazily, at call time.
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"{key}={spec}: importing {path} raised {type(exc).__name__}: {first_line(exc)}") from None
    return module


def load_object(spec: str, key: str, builtins: dict, what: str = "function"):
    """The object ``spec`` names: a key of ``builtins``, ``FILE.py:Name`` or ``module:Name``."""
    if spec in builtins:
        return builtins[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        named = f"a built-in ({', '.join(builtins)}), " if builtins else ""
        hint = f" (the {what} after a colon: {spec}:name)" if spec.endswith(".py") and not sep else ""
        raise ConfigError(f"{key}={spec}: expected {named}path/to/file.py:{what} or package.module:{what}{hint}")
    if names_file(target):
        module = _load_file(target, key, spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"{key}={spec}: cannot import module {target!r}: {first_line(exc)}") from None
        except Exception as exc:
            raise ConfigError(f"{key}={spec}: importing {target} raised {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{key}={spec}: {target} has no {what} {attr!r}")
    if not callable(obj):
        raise ConfigError(f"{key}={spec}: {target}.{attr} is not callable")
    return obj


def load_registered(spec: str, key: str, builtins: dict, kind: type, what: str, refusal: str, loaded: dict):
    """The ``kind`` instance ``spec`` names: a key of ``builtins`` or the user's
    ``path/to/file.py:NAME`` / ``package.module:NAME``, imported once per spec (kept in ``loaded``).
    A mistyped built-in is one ConfigError with the closest name; an object of another type one
    saying ``refusal`` (how to register it)."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in str(spec):
        close = difflib.get_close_matches(str(spec), builtins, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}: got {spec!r}; allowed values: {', '.join(builtins)}, or "
                          f"path/to/file.py:NAME / package.module:NAME of your own{hint}")
    if spec not in loaded:
        found = load_object(spec, key, builtins, what=what)
        if not isinstance(found, kind):
            raise ConfigError(f"{key}={spec}: {spec.rpartition(':')[2]} is not {refusal}")
        loaded[spec] = found
    return loaded[spec]
