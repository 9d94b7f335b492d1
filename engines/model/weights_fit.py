"""Whether a checkpoint directory's weights are the model its config.json describes, read from
the safetensors headers and a meta-device build of the config (no tensor data is read, nothing
is allocated): the check a job makes before training on a model it builds later (the
distillation teacher, built when the RL phase starts).

transformers refuses a shape mismatch when it loads (builder.py turns that into one line), but
it loads a checkpoint with more layers than its config says and drops the rest: only a check
like this one catches that. It compares names as they are stored, so a model type whose
checkpoints transformers renames or converts on load (fused MoE experts, a vision-language
model's older key layout) is left to the load itself, and so is a checkpoint of another class
than the one built (a classifier where a causal LM is needed: the load says which class it is).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


def _stored_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` of every ``*.safetensors`` file in ``directory``; None without
    any (a ``.bin`` checkpoint) or with an unreadable one (the load names the file)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    shapes = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    except (SafetensorError, OSError):
        return None
    return shapes


def _renamed_on_load(model, stored: dict) -> bool:
    """Whether transformers renames or converts this model's stored weights when it loads them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older transformers: no conversions to miss
        return False
    if get_model_conversion_mapping(model, add_legacy=False):
        return True
    legacy = [p for t in get_model_conversion_mapping(model) for p in getattr(t, "source_patterns", ())]
    return any(re.search(pattern, name) for pattern in legacy for name in stored)


def _ignored(patterns) -> re.Pattern | None:
    patterns = set(patterns or ())
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def weights_mismatch(directory: str, hf_config, auto_class) -> str | None:
    """None when the safetensors weights in ``directory`` are exactly what ``hf_config`` builds
    with ``auto_class`` (or when they cannot be compared by name, see the module doc); otherwise
    one sentence naming the first mismatching tensor with both shapes, or the missing or
    unexpected tensors."""
    stored = _stored_shapes(Path(directory))
    if stored is None or getattr(hf_config, "quantization_config", None) is not None:
        return None
    with torch.device("meta"):
        model = auto_class.from_config(hf_config)
    named = getattr(hf_config, "architectures", None) or []
    if (named and type(model).__name__ not in named) or _renamed_on_load(model, stored):
        # Another class's checkpoint (a classifier for a causal LM): the load names the class it holds.
        return None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if not expected.keys() & stored.keys():
        return None  # another naming (e.g. a base model saved without its head's prefix): the load decides
    for name in sorted(expected.keys() & stored.keys()):
        if expected[name] != stored[name]:
            return (f"{name} is {list(stored[name])} in the weights, but its config.json builds it as "
                    f"{list(expected[name])}")
    # A tied parameter (lm_head sharing the embedding) is stored once, under any of its names.
    names_of: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    aliases = {name: names for names in names_of.values() for name in names}
    skip_missing = _ignored(getattr(model, "_keys_to_ignore_on_load_missing", None))
    missing = sorted(name for name in expected.keys() - stored.keys()
                     if not aliases.get(name, set()) & stored.keys()
                     and not (skip_missing and skip_missing.search(name)))
    unexpected_patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    unexpected_patterns |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}  # old buffers transformers drops
    skip_unexpected = _ignored(unexpected_patterns)
    unexpected = sorted(name for name in stored.keys() - expected.keys() if not skip_unexpected.search(name))
    say = lambda names: ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")  # noqa: E731
    if missing:
        return f"its config.json builds {len(missing)} tensor(s) the weights lack: {say(missing)}"
    if unexpected:
        return f"the weights hold {len(unexpected)} tensor(s) its config.json does not build: {say(unexpected)}"
    return None
