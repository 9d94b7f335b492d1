"""Backend selection: explicit requests fail loudly, ``auto`` falls back quietly."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .base import Backend, BackendUnavailableError, UnknownBackendError
from .cpu import CPUBackend
from .cuda import CUDABackend
from .npu import NPUBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu", "cuda", "npu")
AUTO_ORDER = ("npu", "cuda", "cpu")
ENV_OVERRIDE = "POLYFSDP_BACKEND"

_FACTORIES = {"cpu": CPUBackend, "cuda": CUDABackend, "npu": NPUBackend}
_instances: dict[str, Backend] = {}
_logged_fallbacks: set[str] = set()


@dataclass(frozen=True)
class BackendStatus:
    """Whether one backend is usable here, and if not, why."""

    name: str
    available: bool
    reason: str | None


def _instance(name: str) -> Backend:
    if name not in _instances:
        _instances[name] = _FACTORIES[name]()
    return _instances[name]


def _check_name(name: str, source: str) -> str:
    name = name.strip().lower()
    if name not in BACKEND_NAMES:
        raise UnknownBackendError(f"{source}: unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return name


def available_backends() -> list[BackendStatus]:
    """Every backend, in auto-selection order, with its availability and reason."""
    statuses = []
    for name in AUTO_ORDER:
        reason = _instance(name).availability()
        statuses.append(BackendStatus(name, reason is None, reason))
    return statuses


def backend_memory_is_host(name: str) -> bool:
    """Whether backend ``name`` computes in host memory, without requiring it to be usable
    here (a GPU job may be estimated on a laptop); ``auto`` is what this machine would pick."""
    return unchecked_backend(name).memory_is_host


def unchecked_backend(name: str) -> Backend:
    """Backend ``name`` for what it declares, without requiring it to be usable here (a GPU
    job's memory may be estimated on a laptop); ``auto`` is what this machine would pick."""
    name = _check_name(name, "backend")
    return get_backend("auto") if name == "auto" else _instance(name)


def get_backend(name: str = "auto") -> Backend:
    """Return the backend called ``name`` (auto | cpu | cuda | npu).

    ``POLYFSDP_BACKEND`` overrides ``auto``. An explicit name that cannot run here raises
    :class:`BackendUnavailableError` with the reason; ``auto`` tries npu, cuda, cpu.
    """
    name = _check_name(name, "backend")
    if name == "auto" and os.environ.get(ENV_OVERRIDE):
        name = _check_name(os.environ[ENV_OVERRIDE], ENV_OVERRIDE)
    if name != "auto":
        backend = _instance(name)
        reason = backend.availability()
        if reason is not None:
            raise BackendUnavailableError(f"backend {name!r} is not usable: {reason}")
        return backend
    for candidate in AUTO_ORDER:
        backend = _instance(candidate)
        reason = backend.availability()
        if reason is None:
            return backend
        if candidate not in _logged_fallbacks:
            _logged_fallbacks.add(candidate)
            logger.info("backend auto-selection skipped %s: %s", candidate, reason)
    raise BackendUnavailableError("no backend is usable (the CPU backend should always be)")


def _reset_cache() -> None:
    """Forget created backends (tests swap torch_npu stand-ins in and out)."""
    _instances.clear()
    _logged_fallbacks.clear()
