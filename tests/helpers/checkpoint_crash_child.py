"""`polyfsdp-train` that dies like SIGKILL (``os._exit``: no cleanup, no flush) at one chosen
point of the checkpoint save of a chosen step.

Usage: python checkpoint_crash_child.py STEP POINT [overrides...]. The points of a save are
counted from 1 in the order they happen: before each file-system stage of
``engines/checkpoint/`` and ``engines/checkpoint/layout.py`` (the DCP shards, each plain
file, the manifest, the rename into place, the ``latest`` pointer), halfway through each deletion of an old checkpoint (half of
its files gone), and right after each save returns. Every save whose step is STEP counts (a
PPO step of older code saved the critic and the actor separately). The child prints
``CRASH POINT <n> <stage>`` on stderr before it dies; a POINT past the last one lets the run
finish."""
import os
import shutil
import sys
from pathlib import Path

from polyfsdp.engines import checkpoint
from polyfsdp.engines.checkpoint import layout as checkpoint_layout
from polyfsdp.engines.checkpoint import verdict as checkpoint_verdict

STEP, POINT = int(sys.argv[1]), int(sys.argv[2])
CRASH_EXIT = 137  # what a shell reports for SIGKILL
seen = [0]
armed = [False]


def _reached(stage: str) -> bool:
    if not armed[0]:
        return False
    seen[0] += 1
    if seen[0] != POINT:
        return False
    print(f"CRASH POINT {POINT} {stage}", file=sys.stderr, flush=True)
    return True


def _crash() -> None:
    os._exit(CRASH_EXIT)


def _before(stage: str, real):
    def hooked(*args, **kwargs):
        if _reached(stage):
            _crash()
        return real(*args, **kwargs)
    return hooked


def _halfway_rmtree(real):
    def hooked(path, *args, **kwargs):
        if _reached("rmtree"):
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            for file in files[: max(1, len(files) // 2)]:
                file.unlink()
            _crash()
        return real(path, *args, **kwargs)
    return hooked


class _Overlay:
    """A module with some attributes replaced (the checkpoint code looks them up at call time)."""

    def __init__(self, module, **replaced):
        self._module, self._replaced = module, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)


real_save = checkpoint.save_checkpoint


def save_with_crash_points(directory, step, **kwargs):
    armed[0] = step == STEP
    result = real_save(directory, step, **kwargs)
    if _reached("returned"):
        _crash()
    armed[0] = False
    return result


checkpoint.save_checkpoint = save_with_crash_points
checkpoint.dcp = _Overlay(checkpoint.dcp, save=_before("dcp.save", checkpoint.dcp.save))
checkpoint.save_plain = _before("save_plain", checkpoint.save_plain)
checkpoint.write_manifest = _before("write_manifest", checkpoint.write_manifest)
# The renames, the pointer and the deletions are checkpoint_layout's; the save's own rmtree
# (a leftover temporary directory) and a failed stage's (checkpoint_verdict) count too.
checkpoint_layout.os = _Overlay(os, rename=_before("rename", os.rename))
checkpoint_layout.write_pointer = _before("write_pointer", checkpoint_layout.write_pointer)
for module in (checkpoint, checkpoint_layout, checkpoint_verdict):
    module.shutil = _Overlay(shutil, rmtree=_halfway_rmtree(shutil.rmtree))

from polyfsdp.trainer import train  # noqa: E402  (after the hooks: nothing else holds the originals)

sys.exit(train.main(sys.argv[3:]))
