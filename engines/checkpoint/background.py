"""A checkpoint save finishing in the background (``save_checkpoint(background=True)``).

At most one is in flight per process: every save and load first waits for it
(:func:`wait_for_background_save`), so saves commit in step order and a load never reads a
directory a save is still writing.
"""
from __future__ import annotations

import threading
from pathlib import Path


class PendingCheckpoint:
    """A save finishing on a background thread (``save_checkpoint(background=True)``): its shards,
    the manifest, the rename into place and ``latest``. ``wait()`` returns the checkpoint's path
    or raises the save's one-line :class:`CheckpointSaveError` (on every rank alike)."""

    def __init__(self, final: Path, finish) -> None:
        self.path = final
        self._error: BaseException | None = None

        def run() -> None:
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 - handed to wait()
                self._error = exc

        # A daemon: a process that ends without waiting leaves a .tmp- directory, never a checkpoint.
        self._thread = threading.Thread(target=run, name=f"polyfsdp-save-{final.name}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def failed(self) -> bool:
        """Whether it finished with an error (which ``wait()`` raises)."""
        return self.done() and self._error is not None

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path


# The background save in flight (one at most): a save or load first waits for it.
_pending: list[PendingCheckpoint] = []


def start_background_save(final: Path, finish) -> PendingCheckpoint:
    """Run ``finish`` (the rest of the save of ``final``) on a thread; the one save in flight."""
    wait_for_background_save()
    _pending.append(PendingCheckpoint(final, finish))
    return _pending[-1]


def wait_for_background_save() -> Path | None:
    """Wait for the background save in flight, if any; its path (None when there was none)."""
    if not _pending:
        return None
    return _pending.pop().wait()
