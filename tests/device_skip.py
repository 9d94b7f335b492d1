"""Skip a device test folder cleanly when its backend cannot run here."""
from __future__ import annotations

import pytest

from polyfsdp.backends import BackendUnavailableError, get_backend


def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run here, else the backend layer's reason."""
    try:
        get_backend(name)
    except BackendUnavailableError as exc:
        return str(exc)
    return None


def missing_devices_reason(name: str, count: int) -> str | None:
    """None when backend ``name`` runs here with at least ``count`` devices (one per local rank)."""
    reason = unavailable_reason(name)
    if reason is not None:
        return reason
    found = get_backend(name).device_count()
    return None if found >= count else f"needs {count} {name} devices (one per rank), found {found}"


def skip_folder_without_backend(items, backend_name: str, folder: str) -> None:
    """Mark every collected test under ``tests/<folder>/`` skipped when the backend is absent."""
    reason = unavailable_reason(backend_name)
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if f"/tests/{folder}/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(marker)
