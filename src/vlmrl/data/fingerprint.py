"""A dataset's fingerprint: what a resumed run compares to know it reads the data its run started on.

Cheap but honest: for a source read from disk (data files, a folder of them, an imagefolder, a
`save_to_disk` folder) every file's name, size and BLAKE2b hash of its contents (reading the bytes
once costs less than decoding the images the loader checks anyway); for a hub dataset from the cache
or a `datasets` object from Python, each split's row count and the `datasets` library's own
`_fingerprint` (a hash of its table and of the transforms that made it: the same rows give the same
one in every process). The image and video files the rows name by path are covered too, each by its
size and hash, as the data files are (the loader decodes each image anyway, which costs more than
reading its bytes once more; an image replaced under the same name used to resume unnoticed). No
torch here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from vlmrl.data.sources import Source

CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """`SIZE bytes blake2b:HEX` of a file's contents (16 hex digits are plenty to see an edit)."""
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return f"{path.stat().st_size} bytes blake2b:{digest.hexdigest()}"


def source_files(source: Source) -> tuple[Path, list[Path]] | None:
    """(root, files) of a source read from disk, sorted; None for a hub id or a Python object."""
    named = sorted({Path(f) for files in source.files.values() for f in files})
    path = Path(source.name).expanduser() if source.name else None
    if path is None or not path.exists():
        return None
    root = path if path.is_dir() else path.parent
    if not named:  # a save_to_disk folder or an imagefolder: all of it, but links out of it (data/paths.py)
        inside = root.resolve()
        named = sorted(p for p in root.rglob("*") if p.is_file() and p.resolve().is_relative_to(inside))
    return root, named


def fingerprint(source: Source, named: Iterable[Path] = ()) -> dict[str, str]:
    """{what: digest}: a file (relative to the source's folder) -> its size and hash, or
    `split NAME` -> its rows and `datasets` fingerprint; then each file of `named` (the images and
    videos the rows name) not among them -> its size and hash."""
    found = source_files(source)
    if found is not None:
        root, files = found
        prints = {_relative(path, root): file_digest(path) for path in files}
    else:  # no folder: the files by their absolute paths (the same from any working folder)
        root = None
        prints = {f"split {name}": f"{len(ds)} rows, datasets fingerprint {ds._fingerprint}"
                  for name, ds in sorted(source.splits.items())}
    for path in sorted(set(named)):
        prints.setdefault(_relative(path, root.resolve()) if root is not None else str(path), file_digest(path))
    return prints


def _relative(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def differences(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What changed from fingerprint `old` to `new`, one entry each: `NAME: OLD -> NEW`, `NAME added`,
    `NAME removed`."""
    found = []
    for name in dict.fromkeys([*old, *new]):
        if name not in old:
            found.append(f"{name} added")
        elif name not in new:
            found.append(f"{name} removed")
        elif old[name] != new[name]:
            found.append(f"{name}: {old[name]} -> {new[name]}")
    return found
