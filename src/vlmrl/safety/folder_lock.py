"""One process at a time in a folder: a run's output_dir while it trains, a study's while it runs.

Two trainers writing one run folder interleave their metrics.jsonl and overwrite each other's
checkpoints; two studies on one output folder start the same runs twice. `hold(folder, what)`
takes an exclusive lock on FOLDER/.lock and writes the holder's process id into it; a folder that
another live process holds is a `FolderBusy` error naming that process. The lock is a POSIX record
lock (fcntl.lockf), so:

- the kernel drops it when its process ends, however it ends (a crash, SIGKILL): the .lock file a
  dead process leaves behind never blocks anyone;
- it belongs to the process: a forked worker does not inherit it, and the process that holds a
  folder may take it again (a notebook calling train() again after an error, before the first
  session was closed). Each `hold` is given back by its own `release()`; the lock goes when the last
  one is given back.

A filesystem without locks (some network mounts) is said in a warning, and the run goes on unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from vlmrl.errors import VlmrlError, warn

LOCK_FILE = ".lock"

_HELD: dict[str, list[int]] = {}
"""This process's locks: the lock file's real path -> [its descriptor, how many holds]."""

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""What lockf says on a filesystem that has no locks."""


class FolderBusy(VlmrlError):
    """The folder is held by another live process."""


@dataclass
class FolderLock:
    """A hold on a folder (see the module doc); `release()` gives it back."""

    key: str | None
    """The lock file's real path (the key of this process's holds); None: no lock could be taken."""

    def release(self) -> None:
        """Give this hold back (once); the lock goes with the process's last hold."""
        key, self.key = self.key, None
        held = _HELD.get(key) if key is not None else None
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            os.ftruncate(held[0], 0)  # no process id left in a free lock file
            os.close(held[0])  # the kernel drops the lock


def hold(folder: str | Path, what: str) -> FolderLock:
    """Hold `folder` (created if missing) for this process; FolderBusy naming `what` and the
    process that holds it when another live one does."""
    path = Path(folder) / LOCK_FILE
    key = os.path.realpath(path)
    if key in _HELD:  # this process holds it already (never open it twice: closing the second
        _HELD[key][1] += 1  # descriptor would drop the process's lock)
        return FolderLock(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise VlmrlError(f"cannot create the lock file {path}: {error.strerror}") from error
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in _NO_LOCKS:
            os.close(descriptor)
            warn(f"{path.parent} cannot be locked ({error.strerror}): nothing stops a second process using it")
            return FolderLock(None)
        holder = _read_pid(descriptor)
        os.close(descriptor)
        raise FolderBusy(f"{path.parent} is in use by {what}"
                         + (f" (process {holder})" if holder else "")
                         + ": wait for it to end or stop it, or use another folder") from error
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = [descriptor, 1]
    return FolderLock(key)


def holder(folder: str | Path) -> int | None:
    """The id of the live process that holds `folder` (this one's included), or None when no
    process does. Takes nothing."""
    path = Path(folder) / LOCK_FILE
    key = os.path.realpath(path)
    if key in _HELD:
        return os.getpid()
    try:
        descriptor = os.open(path, os.O_RDWR)
    except OSError:
        return None  # no lock file (or none this process may lock): nobody holds it
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        return None if error.errno in _NO_LOCKS else (_read_pid(descriptor) or -1)
    finally:
        os.close(descriptor)  # drops the probe's lock, if it got one
    return None


def _read_pid(descriptor: int) -> int | None:
    """The process id written in a lock file, or None when there is none."""
    text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None
