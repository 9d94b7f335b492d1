"""Every value of the job configuration against its declaration: the one converter from the
composed config (plain dicts) to the declared sections, and the ranges every number must lie in.

The sections declare each field once (``setting`` in engines/config.py: default, doc and range;
trainer/config/sections.py, trainer/config/algo.py, the engine's and the rollout's settings).
:func:`check_bounds` runs first, before torch loads: NaN and infinities (which pass every
``<`` test) and sizes so large that a run would hang, overflow a seed or allocate without end.
A number whose field names no range gets :data:`MAX_MAGNITUDE`. :func:`convert` then builds
the sections: unknown keys, wrong types and the sections' own checks, each one ConfigError
naming the user's key. The ranges are listed in docs/config-reference.md (generated from the
declarations by trainer/config/reference.py).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Iterator

from ..errors import ConfigError

# torch's generators take 64-bit seeds, and the trainer derives per-step, per-rank seeds as
# (seed * 1_000_003 + step) * 1024 + replica: a 32-bit seed keeps that inside the range (the
# per-row sampling seeds, trainer/rollout/row_seeds.py, are hashed to 63 bits whatever the parts).
MAX_SEED = 2**32 - 1
# Counts that allocate (completions, prompts, tokens per completion): far above real runs,
# low enough that a typo (1000000000000) is refused instead of hanging in generation.
MAX_GROUP_SIZE = 2**16
MAX_BATCH = 2**20
MAX_TOKENS = 2**20
# The range of a number no declaration bounds (steps, intervals, coefficients, caps): a
# magnitude up to 1e9, whether the key is an int or a float.
MAX_MAGNITUDE = 10**9
# A time limit beyond a week is a mistake (a silent peer, a hung call).
WEEK_S = 7 * 24 * 3600


def is_section(hint: Any) -> bool:
    """Whether a field's type is a declared section (a dataclass), not a value."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def section_of(hint: Any) -> type | None:
    """The section class a (possibly Optional) field type names, else None."""
    options = [h for h in typing.get_args(hint) if h is not type(None)] if _is_union(hint) else [hint]
    return options[0] if len(options) == 1 and is_section(options[0]) else None


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def declared_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """``cls``'s fields with their resolved types."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f, hints[f.name]


def field_range(f: dataclasses.Field) -> tuple[float, float]:
    """The inclusive range a declared number lies in."""
    low, high = f.metadata.get("low"), f.metadata.get("high")
    return (-MAX_MAGNITUDE if low is None else low), (MAX_MAGNITUDE if high is None else high)


def declared_ranges(cls: type, prefix: str) -> Iterator[tuple[str, float | None, float | None]]:
    """``(dotted key, low, high)`` of every number under ``cls`` that declares a range (and of the
    entries a free-form mapping names); None: the default's end."""
    for f, hint in declared_fields(cls):
        key = f"{prefix}.{f.name}"
        section = section_of(hint)
        if section is not None:
            yield from declared_ranges(section, key)
        elif f.metadata.get("low") is not None or f.metadata.get("high") is not None:
            yield key, f.metadata.get("low"), f.metadata.get("high")
        for entry, (low, high) in (f.metadata.get("entries") or {}).items():
            yield f"{key}.{entry}", low, high


class DeclaredRanges:
    """Every declared range as ``(dotted key, low, high)`` (None: the default's end), read from
    the declarations when iterated: they import this module's limits, so it cannot import them."""

    def __iter__(self):
        from .reference import group_sections

        return (row for group, cls in group_sections().items() for row in declared_ranges(cls, group))


BOUNDS = DeclaredRanges()


def bounds_for(path: str) -> tuple[float, float]:
    """The inclusive range of the number at dotted ``path`` (its declaration's, else the default)."""
    for key, low, high in BOUNDS:
        if key == path:
            return (-MAX_MAGNITUDE if low is None else low), (MAX_MAGNITUDE if high is None else high)
    return -MAX_MAGNITUDE, MAX_MAGNITUDE


def _show(number: float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


def _check_number(path: str, value: Any, low: float | None, high: float | None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number, got {value}")
    if low is None:  # a free-form mapping's entry that declares no range
        return
    if not low <= value <= high:
        limit = f"at most {_show(high)}" if value > high else f"at least {_show(low)}"
        raise ConfigError(f"{path}: expected {limit}, got {_show(value)} (the bounds are in "
                          f"docs/config-reference.md)")


def _nested_numbers(node: Any, path: str, entries: dict | None) -> None:
    """The numbers inside a list or mapping value: each in the default range, except in a
    free-form mapping handed to someone else (``entries`` not None: a Hugging Face config, a
    function's keywords), where only NaN and infinities are refused, and the ranges of the
    entries its field names."""
    default = (None, None) if entries is not None else (-MAX_MAGNITUDE, MAX_MAGNITUDE)
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if items is None:
        _check_number(path, node, *default)
        return
    for key, value in items:
        where = f"{path}.{key}" if isinstance(node, dict) else f"{path}[{key}]"
        if isinstance(value, (dict, list)):
            _nested_numbers(value, where, None if entries is None else {})
        else:
            _check_number(where, value, *(entries or {}).get(key, default))


def check_section_bounds(cls: type, data: Any, where: str) -> None:
    """ConfigError naming the first number under ``data`` (a composed section) that is NaN,
    infinite or outside its declared range; keys not declared are left to :func:`convert`."""
    if not isinstance(data, dict):
        return
    for f, hint in declared_fields(cls):
        if f.name not in data:
            continue
        value, key = data[f.name], f"{where}.{f.name}"
        section = section_of(hint)
        if section is not None:
            check_section_bounds(section, value, key)
        elif isinstance(value, (dict, list)):
            _nested_numbers(value, key, f.metadata.get("entries"))
        else:
            _check_number(key, value, *field_range(f))


def check_bounds(raw: dict) -> None:
    """Every group's numbers in ``raw`` (the composed config) against their declarations."""
    from .reference import group_sections

    for group, cls in group_sections().items():
        check_section_bounds(cls, raw.get(group), group)


# --------------------------------------------------------------------------- types


def _type_ok(value: Any, hint: Any) -> bool:
    if _is_union(hint):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(value, origin) if isinstance(origin, type) else True


def describe_type(hint: Any) -> str:
    if _is_union(hint):
        return " or ".join(describe_type(a) for a in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(typing.get_origin(hint) or hint, "__name__", str(hint))


def convert(cls: type, data: Any, where: str, unknown_key=None):
    """Build section ``cls`` from a composed mapping: unknown keys (``unknown_key(dotted)`` may
    explain one: a renamed or verl key) and wrong types are ConfigErrors naming ``where.key``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    if hasattr(cls, "from_dict"):
        # The engine's configs check their own keys and types on construction (its public API):
        # their messages stay theirs, under the user's key.
        try:
            return cls.from_dict(data, where=where)
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None
    declared = dict((f.name, hint) for f, hint in declared_fields(cls))
    for key in data:
        if key not in declared:
            reason = unknown_key(f"{where}.{key}") if unknown_key else None
            raise ConfigError(f"{where}.{key}: {reason or 'unknown key; known keys: ' + ', '.join(declared)}")
    kwargs = {}
    for key, value in data.items():
        hint, section = declared[key], section_of(declared[key])
        if section is not None:  # null: the section's own check says whether it may be absent
            kwargs[key] = None if value is None else convert(section, value, f"{where}.{key}", unknown_key)
            continue
        if isinstance(value, int) and not isinstance(value, bool) and _type_ok(1.0, hint) and not _type_ok(1, hint):
            value = float(value)
        if not _type_ok(value, hint):
            raise ConfigError(f"{where}.{key}: expected {describe_type(hint)}, got {value!r}")
        kwargs[key] = tuple(value) if typing.get_origin(hint) is tuple else value
    return cls(**kwargs)


def defaults_of(cls: type) -> dict:
    """The declared defaults of section ``cls`` as plain data (Hydra's base node of a group)."""
    out = {}
    for f, hint in declared_fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            value = defaults_of(type(value))
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out
