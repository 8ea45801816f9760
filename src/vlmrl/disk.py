"""Disk space: what a run will write against what its filesystem has free, and a full disk as one
clear error.

A full fine-tune of a 3B model writes about 28 GB per checkpoint (weights and AdamW's two moments);
with `train.keep_checkpoints` of them, the one being written and the final model, a 64 GB disk
fills up mid-run. `DiskEstimate` (filled in by the preflight, which knows the model's sizes) says
before step 1 whether the run's writes fit. `writing(what, path)` turns a full disk while writing
a checkpoint, the final model, metrics, rollouts or the report into a `DiskFull` error that names
what was written, where, and how much is free, instead of a traceback from safetensors or torch.

What a command writes for a person (`vlmrl data geometry`, `attention`, `report`, `eval`, `tasks
show`, `config --save`, `tiny-model`) goes through `output_folder` (or `output_file`), checked
before the work, and `write_file`: a folder that is a file, a file name that is a folder, a path
under /proc, one the user cannot write, or a full disk is one line (a VlmrlError, exit 2), and a
file is written under a temporary name in its own folder and renamed over its place once whole, so
a failed write never leaves a half-written file that later reads as data.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vlmrl.errors import VlmrlError

FULL_MARKERS = ("no space left on device", "storagefull", "os error 28", "disk quota exceeded", "unexpected pos",
                "file write failed")
"""How a full disk reads in errors that are not OSErrors (safetensors' Rust IoError, torch). torch's
zip writer says only "unexpected pos N vs M" or "file write failed" when a write came up short,
which is what a full disk (or quota) does to it."""


class DiskFull(VlmrlError):
    """The disk filled up while the run was writing."""


def gib(n: int) -> str:
    """Bytes in the unit that reads best."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2 ** 10:.0f} KiB"


def free_space(path: Path) -> tuple[int | None, Path]:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing folder), and
    that folder; (None, path) when it cannot be read."""
    folder = Path(path).absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free, folder
    except OSError:
        return None, folder


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) says the disk or the quota is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(error).lower() for marker in FULL_MARKERS):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def writing(what: str, path: Path):
    """Within: a full disk while writing `what` to `path` is a DiskFull error saying so."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as error:
        if not is_disk_full(error):
            raise
        raise cannot_write(what, path, error) from error


def cannot_write(what: str, path: Path, error: Exception) -> VlmrlError:
    """The one-line error of an OSError (or a full disk told otherwise) met while writing `what` to `path`."""
    if is_disk_full(error):
        free, folder = free_space(path)
        left = "unknown" if free is None else gib(free)
        return DiskFull(f"the disk is full: writing {what} to {path} failed ({left} free on the filesystem of "
                        f"{folder})")
    filename = getattr(error, "filename", None)
    culprit = Path(filename) if isinstance(filename, str) and filename else path
    in_the_way = next((folder for folder in (culprit, *culprit.parents) if folder.exists()), None)
    if Path(path).absolute().parts[1:2] in (("proc",), ("sys",), ("dev",)):
        reason = f"/{Path(path).absolute().parts[1]} is the kernel's virtual filesystem, not a place for files"
    elif isinstance(error, (FileExistsError, NotADirectoryError)) and in_the_way and not in_the_way.is_dir():
        reason = f"{in_the_way} is a file, not a folder"
    elif isinstance(error, IsADirectoryError):
        reason = f"{culprit} is a folder, not a file"
    elif isinstance(error, PermissionError):
        reason = f"permission denied on {culprit}"
    else:
        reason = f"{getattr(error, 'strerror', None) or type(error).__name__} ({culprit})"
    return VlmrlError(f"cannot write {what} to {path}: {reason}; choose another path")


def _writable_folder(folder: Path) -> None:
    """Make `folder` if need be and check that a file can be made in it (OSError if not)."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    probe_writable(folder)


def probe_writable(folder: Path) -> None:
    """Make and remove a file in `folder`; OSError, said of the folder (the probe's name means nothing
    to the user), when it cannot be. The name is this process's and this thread's own: two runs that
    start at once (two processes, two threads of a notebook) never remove each other's probe."""
    probe = folder / f".vlmrl-write-check.{os.getpid()}.{threading.get_ident()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise type(error)(error.errno, error.strerror, str(folder)) from error


def output_folder(path: str | Path, what: str) -> Path:
    """`path` as a folder to write `what` into: created if need be and checked writable (a file made
    and removed in it), before any work; a one-line VlmrlError when it cannot be."""
    folder = Path(path)
    try:
        _writable_folder(folder)
    except OSError as error:
        raise cannot_write(what, folder, error) from error
    return folder


def output_file(path: str | Path, what: str) -> Path:
    """`path` as a file to write `what` to, checked before any work: not a folder, in a folder that
    is made if need be and writable; a one-line VlmrlError when it cannot be. Nothing is written to it."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        _writable_folder(path.parent)
    except OSError as error:
        raise cannot_write(what, path, error) from error
    return path


def safe_filename(text: str) -> str:
    """`text` with every character other than letters, digits, `.`, `_` and `-` replaced by `_` (a task
    named by import path, `my.tasks:Letters`, gives a file name every filesystem takes)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def write_file(path: str | Path, what: str, write: Callable[[Path], None]) -> Path:
    """Write `what` to `path` whole or not at all: `write(temporary)` writes a temporary file in the
    same folder (named `.NAME.PID.tmp`, so no reader takes it for data: give the format explicitly,
    the name has no usual suffix), which then replaces `path` in one rename. A failure removes the
    temporary file and is a one-line VlmrlError (DiskFull for a full disk). Returns `path`."""
    path = Path(path)
    temporary = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        write(temporary)
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        if isinstance(error, VlmrlError):  # from a nested write: it has said what and where
            raise
        if isinstance(error, OSError) or (isinstance(error, Exception) and is_disk_full(error)):
            raise cannot_write(what, path, error) from error
        raise
    return path


def write_text(path: str | Path, what: str, text: str) -> Path:
    """`write_file` of UTF-8 text (characters that cannot be encoded replaced)."""
    return write_file(path, what, lambda temporary: temporary.write_text(text, encoding="utf-8", errors="replace"))


@dataclass
class DiskEstimate:
    """What a run will write at most at one time, in bytes, against the free space where it writes."""

    checkpoint: int
    """One step checkpoint: weights (or the LoRA adapter), optimizer state, the reference copy."""
    checkpoints: int
    """Step checkpoints on disk at once at most: those kept, plus the one being written."""
    final: int
    """The final model."""
    logs: int
    """Rollout logs and metrics over the whole run (a rough guess)."""
    free: int | None
    """Free bytes on the output filesystem, None when unknown."""
    where: Path
    """The folder whose filesystem that is."""

    @property
    def total(self) -> int:
        return self.checkpoint * self.checkpoints + self.final + self.logs

    @property
    def fits(self) -> bool | None:
        return None if self.free is None else self.total <= self.free

    def line(self) -> str:
        """The preflight's report line."""
        verdict = "free space unknown" if self.free is None else (
            f"{gib(self.free)} free on {self.where}: " + ("fits" if self.fits else "DOES NOT FIT"))
        return (f"disk       about {gib(self.total)} written at most ({self.checkpoints} x {gib(self.checkpoint)} "
                f"checkpoints, final model {gib(self.final)}, logs {gib(self.logs)}); {verdict}")

    def advice(self) -> str:
        return (f"this run may fill its disk: it writes up to {gib(self.total)} under {self.where}, which has "
                f"{gib(self.free or 0)} free. Lower train.keep_checkpoints, save less often (train.save_every), "
                "train a LoRA adapter (model.lora.enabled=true), or write elsewhere (output_dir)")
