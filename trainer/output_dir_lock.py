"""One run per output directory: ``polyfsdp-train`` holds ``OUTPUT_DIR/run.lock`` from before it
writes anything until it exits, whichever way it exits (:func:`hold_output_dir`).

Two runs writing one directory interleave metrics.jsonl and delete each other's temporary
checkpoints, so a second run is refused in one line naming the holder. The lock is a file created
with ``O_EXCL`` (atomic, NFS included) that says who made it: host, pid, the process's start time
and the boot it belongs to. ``kill -9`` leaves it behind, so a lock whose holder is gone (same host
and boot; the pid is not running, is a zombie, or now belongs to a process started at another
time) is stale, and the next run takes it over with one line: ``trainer.resume=auto`` after a kill
just works. A holder on another host cannot be checked from here: refused, the line says how to
clear it. Rank 0 takes the lock; every rank learns the outcome (trainer/rank_errors.py).
"""
from __future__ import annotations

import json
import os
import socket
import stat
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from polyfsdp.backends.distributed import current_rank

from .errors import ConfigError
from .rank_errors import on_every_rank

LOCK_FILE = "run.lock"
# A lock file is created empty and then written: a reader that finds it empty or cut short
# waits this long for its writer before calling it unreadable.
UNREADABLE_WAIT_S = 1.0


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` from the state on (field 3), None when there is no such
    process; raises OSError where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except FileNotFoundError:
        return None


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot: with the pid it names one process
    for the machine's uptime, which the pid alone does not once pids wrap); None off Linux."""
    try:
        fields = _proc_stat(pid)
    except OSError:
        return None
    return fields[19] if fields else None  # field 22, starttime


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class Holder:
    """Who holds a lock; ``token`` tells this acquisition from any other (the same pid may take
    the lock twice in one process, one run after another)."""

    host: str
    pid: int
    started: str | None
    boot: str | None
    taken_at: str
    token: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), start_time(os.getpid()), _boot_id(),
                   time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), uuid.uuid4().hex)

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, since {self.taken_at}"

    def gone(self) -> bool | None:
        """Whether the holding process has ended; None when it cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        boot = _boot_id()
        if self.boot and boot and self.boot != boot:
            return True  # the machine restarted since: its pids are other processes now
        try:
            fields = _proc_stat(self.pid)
        except OSError:  # no /proc: the pid alone says it
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:  # another user's process
                return False
            return False
        if fields is None or fields[0] in ("Z", "X"):
            return True  # no such process, or one killed and not yet reaped by its parent
        return self.started is not None and fields[19] != self.started  # the pid was reused


# A lock polyfsdp-train writes is one short JSON line: reading more means it is no lock of ours.
MAX_LOCK_BYTES = 4096


def _lock_text(path: Path) -> str:
    """The content of lock file ``path``, read without following a symbolic link and only from a
    regular file (OSError otherwise): a crafted directory's lock linked to /dev/zero, or a FIFO,
    would never finish reading. FileNotFoundError when it is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, MAX_LOCK_BYTES).decode()
    finally:
        os.close(fd)


def _read(path: Path) -> Holder | None:
    """The holder ``path`` names; None when it is unreadable after :data:`UNREADABLE_WAIT_S`.
    Raises FileNotFoundError when it is gone (its holder released it meanwhile)."""
    deadline = time.monotonic() + UNREADABLE_WAIT_S
    while True:
        try:
            holder = Holder(**json.loads(_lock_text(path)))
            if isinstance(holder.host, str) and isinstance(holder.pid, int) and isinstance(holder.token, str):
                return holder
        except FileNotFoundError:
            raise
        except OSError:  # not readable by this user, a directory, a link, a FIFO: no run of ours made it
            return None
        except (ValueError, TypeError):  # UnicodeDecodeError included
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _remove_stale(path: Path, stale: Holder, me: Holder) -> None:
    """Remove the lock of ``stale`` unless another run replaced it meanwhile: it is moved aside
    first (one atomic rename), checked, and put back if it is not the stale one."""
    aside = path.with_name(f"{LOCK_FILE}.stale-{me.token}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = _read(aside)
    except FileNotFoundError:
        return
    if moved is not None and moved.token != stale.token:
        try:
            os.link(aside, path)  # fails only if a third run created a lock in this instant
        except OSError:
            pass
    os.unlink(aside)


def _refusal(out: Path, holder: Holder | None) -> ConfigError:
    path = out / LOCK_FILE
    if holder is None:
        return ConfigError(f"trainer.output_dir {out}: {path} is not a lock polyfsdp-train can read; if no run "
                           f"is writing to this directory, delete it and run again")
    if holder.gone() is None:
        return ConfigError(f"trainer.output_dir {out}: another run holds it ({holder.describe()}), which this host "
                           f"cannot check; if that run has ended, delete {path} and run again")
    return ConfigError(f"trainer.output_dir {out}: another run is writing to it ({holder.describe()}); wait for "
                       f"it to end or choose another trainer.output_dir")


def take_lock(out: Path, say: Callable[[str], None]) -> Holder:
    """Create ``out`` (if needed) and its lock for this process; a ConfigError when another run
    holds it. A stale lock is taken over with one line through ``say``."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"trainer.output_dir: cannot create {out}: {exc.strerror or exc}") from None
    me, path, replaced = Holder.this_process(), out / LOCK_FILE, None
    for _ in range(3):  # a stale lock removed, then this run's create, or another run's first
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                holder = _read(path)
            except FileNotFoundError:
                continue
            if holder is None or not holder.gone():
                raise _refusal(out, holder) from None
            _remove_stale(path, holder, me)
            replaced = holder
            continue
        except OSError as exc:
            raise ConfigError(f"trainer.output_dir: cannot create {path}: {exc.strerror or exc}") from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(asdict(me)))
        except OSError as exc:  # a full disk: no empty lock left behind to refuse the next run
            path.unlink(missing_ok=True)
            raise ConfigError(f"trainer.output_dir: cannot write {path}: {exc.strerror or exc}") from None
        if replaced is not None:
            say(f"trainer.output_dir {out}: took over the lock of a run that ended without releasing it "
                f"({replaced.describe()}; killed?)")
        return me
    raise ConfigError(f"trainer.output_dir {out}: other runs keep taking {path}; run one at a time")


def release_lock(out: Path, me: Holder) -> None:
    """Remove ``out``'s lock if it is still ``me``'s (a user may have deleted it, another run taken it)."""
    path = out / LOCK_FILE
    try:
        holder = Holder(**json.loads(_lock_text(path)))
    except (OSError, ValueError, TypeError):
        return
    if holder.token == me.token:
        path.unlink(missing_ok=True)


@contextmanager
def hold_output_dir(out: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold ``out``'s lock for the ``with`` block (every rank calls it; rank 0 takes the lock,
    and a refusal stops every rank with the same line)."""
    rank0 = current_rank() == 0
    me = on_every_rank(lambda: take_lock(out, say) if rank0 else None)
    try:
        yield
    finally:
        if me is not None:
            release_lock(out, me)
