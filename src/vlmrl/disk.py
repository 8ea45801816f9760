"""Disk space: what a run will write against what its filesystem has free, and a full disk as one
clear error.

A full fine-tune of a 3B model writes about 28 GB per checkpoint (weights and AdamW's two moments);
with `train.keep_checkpoints` of them, the one being written and the final model, a 64 GB disk
fills up mid-run. `DiskEstimate` (filled in by the preflight, which knows the model's sizes) says
before step 1 whether the run's writes fit. `writing(what, path)` turns a full disk while writing
a checkpoint, the final model, metrics, rollouts or the report into a `DiskFull` error that names
what was written, where, and how much is free, instead of a traceback from safetensors or torch.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from dataclasses import dataclass
from pathlib import Path

from vlmrl.errors import VlmrlError

FULL_MARKERS = ("no space left on device", "storagefull", "os error 28", "disk quota exceeded")
"""How a full disk reads in errors that are not OSErrors (safetensors' Rust IoError, torch)."""


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
    while not folder.exists() and folder != folder.parent:
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
        free, folder = free_space(path)
        left = "unknown" if free is None else gib(free)
        raise DiskFull(f"the disk is full: writing {what} to {path} failed ({left} free on the filesystem of "
                       f"{folder})") from error


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
