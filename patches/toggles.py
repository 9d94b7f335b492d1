"""Config switches for model patches (Hydra group ``patches``: enabled, disable_families, disable, verify)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


def _names(field_name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"patches.{field_name} must be a list of names (e.g. [qwen2.rope]), "
            f"got {type(value).__name__} {value!r}"
        )
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"patches.{field_name} entries must be strings, got {type(item).__name__} {item!r}")
    return tuple(value)


@dataclass
class PatchToggles:
    """Which patches may apply: all on/off, whole families off, single patches off, verify each.

    Plain data: construction checks types only. Whether the names exist is the registry's
    question (``patches.registry.validate_toggles``, which ``apply_patches`` also calls).
    """

    # ``doc``: what the key means, for the trainer's --help and docs/config-reference.md.
    enabled: bool = field(default=True, metadata={"doc": "false turns every patch off"})
    disable_families: tuple[str, ...] = field(default_factory=tuple,
                                              metadata={"doc": "whole families off, e.g. [qwen2]"})
    disable: tuple[str, ...] = field(default_factory=tuple, metadata={"doc": "single patches off, e.g. [qwen2.rope]"})
    verify: bool = field(default=False, metadata={"doc": "check each patched module against the original once"})

    def __post_init__(self) -> None:
        for name in ("enabled", "verify"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise TypeError(f"patches.{name} must be true or false, got {type(value).__name__} {value!r}")
        self.disable_families = _names("disable_families", self.disable_families)
        self.disable = _names("disable", self.disable)

    @classmethod
    def from_config(cls, config: Any) -> "PatchToggles":
        """Build from None, a PatchToggles, a dict or an OmegaConf/Hydra node; unknown keys are errors."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        try:
            from omegaconf import OmegaConf
        except ImportError:  # omegaconf is a dependency; plain dicts still work without it
            OmegaConf = None
        if OmegaConf is not None and OmegaConf.is_config(config):
            config = OmegaConf.to_container(config, resolve=True)
        if not isinstance(config, Mapping):
            raise TypeError(f"patches config must be a mapping, got {type(config).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(config) - set(allowed))
        if unknown:
            raise ValueError(f"patches: unknown key(s) {', '.join(map(str, unknown))}; allowed keys: {', '.join(allowed)}")
        return cls(**dict(config))
