"""One process at a time in a folder: a run's output_dir while it trains, a study's while it runs.

Two trainers writing one run folder interleave their metrics.jsonl and overwrite each other's
checkpoints; two studies on one output folder start the same runs twice. `hold(folder, what)`
takes an exclusive lock on FOLDER/.lock and writes the holder's process id into it; a folder that
another live process holds is a `FolderBusy` error naming that process. The lock is a POSIX record
lock (fcntl.lockf), so:

- the kernel drops it when its process ends, however it ends (a crash, SIGKILL): the .lock file a
  dead process leaves behind never blocks anyone;
- it belongs to the process: a forked worker does not inherit it. Within the process, vlmrl keeps
  its own record of the folders it holds (`_HELD`, under a thread lock): a folder held by a hold not
  yet given back is refused to a second holder of this process too (another thread's `vlmrl.train`,
  a second session while the first is open), in the same one line. A session gives its hold back when
  it closes, however it ends (an error, Ctrl-C: training/session.py), so a notebook may call train()
  again in the same folder after an error.

A filesystem without locks (some network mounts) is said in a warning, and the run goes on unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from vlmrl.errors import VlmrlError, warn

LOCK_FILE = ".lock"

_HELD: dict[str, int] = {}
"""This process's holds: the lock file's real path -> its descriptor."""

_HELD_LOCK = threading.Lock()
"""Makes looking a folder up in _HELD and taking it one step (two threads cannot both take it)."""

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""What lockf says on a filesystem that has no locks."""


class FolderBusy(VlmrlError):
    """The folder is held by another live process, or by another holder in this one."""


@dataclass
class FolderLock:
    """A hold on a folder (see the module doc); `release()` gives it back."""

    key: str | None
    """The lock file's real path (the key of this process's holds); None once given back."""

    def release(self) -> None:
        """Give this hold back (once): the kernel drops the lock, and the folder is free."""
        key, self.key = self.key, None
        with _HELD_LOCK:
            descriptor = _HELD.pop(key, None) if key is not None else None
        if descriptor is None or descriptor < 0:  # given back already, or a folder that could not be locked
            return
        os.ftruncate(descriptor, 0)  # no process id left in a free lock file
        os.close(descriptor)  # the kernel drops the lock


def hold(folder: str | Path, what: str) -> FolderLock:
    """Hold `folder` (created if missing) for this process; FolderBusy naming `what` and the
    process that holds it when another live one does, or when this process holds it already."""
    path = Path(folder) / LOCK_FILE
    with _HELD_LOCK:
        key = os.path.realpath(path)
        if key in _HELD:  # never open it twice: closing the second descriptor would drop the lock
            raise FolderBusy(f"{path.parent} is in use by {what} in this process (process {os.getpid()}: another "
                             "thread, or a run not yet finished): wait for it to end, or use another folder")
        _HELD[key] = _locked(path, what)
        return FolderLock(key)


def _locked(path: Path, what: str) -> int:
    """A descriptor of the lock file `path` holding its lock, with this process's id written in it;
    -1 on a filesystem without locks (said in a warning: the folder is then held within this process
    only); FolderBusy when another process holds it."""
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
            return -1
        holder = _read_pid(descriptor)
        os.close(descriptor)
        raise FolderBusy(f"{path.parent} is in use by {what}"
                         + (f" (process {holder})" if holder else "")
                         + ": wait for it to end or stop it, or use another folder") from error
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    return descriptor


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
