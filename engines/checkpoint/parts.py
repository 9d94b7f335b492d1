"""What a checkpoint holds, part by part: trained models (sharded) and plain state.

A checkpoint is a set of named parts saved and restored by one mechanism (``engines/checkpoint/__init__.py``):

- :class:`CheckpointPart`: a trained model with its optimizer and scheduler, saved through DCP
  (sharded, reshardable). The engine's own model is the main part; others (PPO's critic) are
  named and go under ``parts.<name>.`` of the same DCP save.
- the caller's plain ``extra`` (the trainer's position: step, data cursor, metrics line count;
  ``trainer/run/state.py``), tensors and plain types only.
- each rank's RNG streams (:func:`rng_state`), one file per rank.

Every part is loaded weights-only: :func:`check_plain` refuses at save time what could not be
loaded back.
"""
from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

logger = logging.getLogger(__name__)


def rng_state(backend) -> dict[str, Any]:
    """This process's RNG states (torch, Python, numpy when installed, the device's)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        # numpy's state holds an ndarray, which weights-only loading refuses: keep it as a tensor.
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"bit_generator": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if backend is not None:
        state["backend"] = backend.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], backend) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            logger.warning("checkpoint holds a numpy RNG state but numpy is not installed; skipped")
        else:
            saved = state["numpy"]
            np.random.set_state((saved["bit_generator"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                                 saved["has_gauss"], saved["cached_gaussian"]))
    if backend is not None and "backend" in state:
        backend.set_rng_state(state["backend"])


_PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor)


def check_plain(value: Any, where: str) -> None:
    """``extra`` is loaded weights-only: refuse at save time what could not be loaded back."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; checkpoint extra keys are str or int")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN_TYPES):
        raise TypeError(f"{where} is a {type(value).__name__}; checkpoint extra holds tensors, str, int, float, bool, "
                        f"None and lists/tuples/dicts of them")


# Only what is trained is saved: frozen parameters (a LoRA run's base model) are rebuilt
# from the model config, so they never change and need no copy in every checkpoint.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
# Loading sets the trained keys only; dcp.load has already refused a checkpoint lacking any of them.
_LOAD_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def sharded_state(model, optimizer) -> dict[str, Any]:
    """The DCP state dict of ``model``'s trained parameters (and ``optimizer``'s state)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_TRAINED_ONLY)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
    return {"model": model_sd, "optim": optim_sd}


@dataclass
class CheckpointPart:
    """One trained model of a checkpoint: its (sharded) module, optimizer and scheduler.

    The engine itself is the checkpoint's main part; a run that trains more models (PPO's
    critic) names each as a part of the same checkpoint, saved and loaded with it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None

    def saved_state(self) -> dict[str, Any]:
        """Model (+ optimizer) state for DCP. get_state_dict() initialises an empty optimizer
        state with a zero-lr step, which would advance Adam's step count of the live run: an
        optimizer that has not stepped yet is left out (and cleared on load) instead."""
        optimizer = self.optimizer if self.optimizer is not None and self.optimizer.state else None
        return sharded_state(self.model, optimizer)

    def saved_info(self, state: dict[str, Any]) -> dict[str, Any]:
        """What trainer_state.pt records of this part besides its shards."""
        return {"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "has_optimizer_state": "optim" in state}

    def state_to_load(self, info: dict[str, Any], where: Path) -> dict[str, Any]:
        """The state dict DCP fills in for this part, given what the checkpoint recorded of it."""
        if self.lr_scheduler is not None and info["lr_scheduler"] is None:
            raise ValueError(f"{where}: checkpoint has no scheduler state but load_checkpoint was given "
                             f"lr_scheduler={self.lr_scheduler!r}; pass lr_scheduler=None")
        load_optim = self.optimizer is not None and info["has_optimizer_state"]
        if self.optimizer is not None and not load_optim:
            self.optimizer.state.clear()  # saved before the first optimizer step
        return sharded_state(self.model, self.optimizer if load_optim else None)

    def restore(self, state: dict[str, Any], info: dict[str, Any]) -> None:
        """Set the model, optimizer and scheduler from the state DCP loaded."""
        if "optim" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=_LOAD_TRAINED_ONLY)
        else:
            set_model_state_dict(self.model, state["model"], options=_LOAD_TRAINED_ONLY)
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(info["lr_scheduler"])
            if self.optimizer is not None:
                # A scheduler's state does not include the optimizer's current lr.
                for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                    group["lr"] = lr


_PART_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_parts(parts: dict | None) -> dict[str, CheckpointPart]:
    """``parts`` as a dict of named :class:`CheckpointPart` (names are identifiers)."""
    parts = dict(parts or {})
    for name, part in parts.items():
        if not isinstance(name, str) or not _PART_NAME.match(name):
            raise ValueError(f"checkpoint part names are identifiers, got {name!r}")
        if not isinstance(part, CheckpointPart):
            raise TypeError(f"checkpoint part {name!r}: expected a CheckpointPart, got {type(part).__name__}")
    return parts
