"""What the declarations say, for people and for Hydra: the section each config group converts
to, every key's type, default, range and meaning as ``polyfsdp-train --help`` lists them and
as docs/config-reference.md tabulates them (``python -m polyfsdp.trainer.config.reference``
rewrites the page; tests/cpu/trainer/config/test_config_declared.py checks the committed one is current).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator

from polyfsdp.engines.config import EngineConfig
from polyfsdp.patches.toggles import PatchToggles

from .algo import ActorSection, AlgoSection, CriticSection
from .bounds import MAX_MAGNITUDE, declared_fields, describe_type, field_range, section_of
from .sections import (BackendSection, DataSection, EvalSection, ModelSection, RewardSection, RolloutSection,
                       TrainerSection)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def group_sections() -> dict[str, type]:
    """The declared section of each config group."""
    return {"backend": BackendSection, "model": ModelSection, "engine": EngineConfig, "patches": PatchToggles,
            "algo": AlgoSection, "data": DataSection, "reward": RewardSection, "rollout": RolloutSection,
            "eval": EvalSection, "trainer": TrainerSection}


def optional_sections() -> dict[str, type]:
    """Sub-sections that are null unless a preset turns them on (``algo.actor``, ``algo.critic``):
    a preset pulls in their declared defaults from Hydra's ``schema`` group."""
    return {"algo.actor": ActorSection, "algo.critic": CriticSection}


def mapping_sections() -> dict[str, type]:
    """Keys whose value is a mapping handed as a whole to a component that declares its keys:
    listed key by key (``reward.judge``: trainer/rewards/judge.py)."""
    from ..rewards.judge import JudgeSettings

    return {"reward.judge": JudgeSettings}


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, str)) else "null" if value is None else \
        str(value).lower() if isinstance(value, bool) else str(value)


def declared_rows(cls: type, prefix: str) -> Iterator[tuple[str, str, str, str, str]]:
    """``(key, type, default, range, doc)`` of every value under section ``cls``."""
    for f, hint in declared_fields(cls):
        key = f"{prefix}.{f.name}"
        section = section_of(hint) or optional_sections().get(key)
        if section is not None:
            yield from declared_rows(section, key)
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        low, high = field_range(f)
        declared = f.metadata.get("low") is not None or f.metadata.get("high") is not None
        span = f"[{_show(low).replace(str(MAX_MAGNITUDE), '1e9')}, {_show(high)}]" if declared else ""
        entries = ", ".join(f"{name} [{lo}, {hi}]" for name, (lo, hi) in (f.metadata.get("entries") or {}).items())
        yield key, describe_type(hint), _show(list(default) if isinstance(default, tuple) else default), \
            span or entries, f.metadata.get("doc", "")
        if key in mapping_sections():
            yield from declared_rows(mapping_sections()[key], key)


def default_job_values() -> dict[str, str]:
    """The default job's value of each key where its preset sets another than the declaration
    (unresolved: ``${if_model_path:A,B}`` stays as written)."""
    from omegaconf import OmegaConf

    from .composition import compose

    composed = OmegaConf.to_container(compose([]), resolve=False)
    out = {}
    for group, cls in group_sections().items():
        for key, _, default, _, _ in declared_rows(cls, group):
            node = composed
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None and _show(node) != default:  # None: not in the default job (algo.critic)
                out[key] = _show(node)
    return out


def help_text() -> str:
    """Every key with its default, range and meaning, for ``polyfsdp-train --help``."""
    preset = default_job_values()
    lines = ["Keys (KEY=VALUE; the declared default, the default job's value where its preset sets another, "
             "[range], meaning):"]
    for group, cls in group_sections().items():
        for key, _, default, span, doc in declared_rows(cls, group):
            shipped = f" (default job: {preset[key]})" if key in preset else ""
            lines.append(f"  {key} = {default}{shipped}" + (f"  {span}" if span else "") + (f"  {doc}" if doc else ""))
    return "\n".join(lines)


def page() -> str:
    """docs/config-reference.md."""
    out = ["# Configuration reference", "",
           "Generated from the declarations (trainer/config/sections.py, trainer/config/algo.py, "
           "engines/config.py, patches/toggles.py, trainer/rollout/servers/settings.py) by "
           "`python -m polyfsdp.trainer.config.reference`; do not edit by hand. `default` is the "
           "declaration's; `default job` is what `polyfsdp-train` with no arguments uses where the presets of "
           "`configs/` it composes set another (`${if_model_path:A,B}`: A with a model.path, B with the built-in "
           "model); another group option (`algo=ppo`, `task=...`) may set others, which `polyfsdp-train --cfg` "
           "shows. A number outside its range, NaN or infinite, is refused before anything runs; a number "
           "without a declared range lies in [-1e9, 1e9].", ""]
    preset = default_job_values()
    for group, cls in group_sections().items():
        out += [f"## {group}", "", "| key | type | default | default job | range | meaning |",
                "| --- | --- | --- | --- | --- | --- |"]
        for key, kind, default, span, doc in declared_rows(cls, group):
            cells = [f"`{key}`", f"`{kind}`", f"`{default}`", f"`{preset[key]}`" if key in preset else "", span,
                     doc.replace("|", "\\|")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    PAGE.write_text(page())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
