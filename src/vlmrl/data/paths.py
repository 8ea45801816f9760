"""Where the files a data row names are read: inside the data folder, unless the user allows more.

A path in a data file (an image's or a video's, a string or an image's `{"path": ...}`) is relative
to the data file's folder, then to the source folder (the `path` given). The file it names, `..`,
absolute paths and symbolic links followed, must lie inside the data folder (the folder given as
`path`, or the data file's folder), or inside `media_root` when the dataset sets one: a data file,
perhaps someone else's, cannot make a run read ~/.ssh or /etc and copy what it read into rollout
logs and the shareable report. A hub dataset or a `datasets` object from Python has no data folder:
its paths are read as its program wrote them (a relative one from the working folder), inside
`media_root` when one is set. A refusal is one line naming the path as written. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.errors import VlmrlError

PREVIEW = 40
"""Characters of a value shown in a message (a base64 image is thousands)."""


class OutsideFile(VlmrlError):
    """A path that names a file outside the folder reads are kept in."""


def preview(value: Any) -> str:
    """`str 'data:image/png;base64,iVBORw0KGgoAAAANSUhE...' (2210 characters)`: a value's type and its
    first characters, for a one-line message."""
    text = value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else str(value)
    shown = repr(text[:PREVIEW] + ("..." if len(text) > PREVIEW else ""))
    return f"{type(value).__name__} {shown}" + (f" ({len(text)} characters)" if len(text) > PREVIEW else "")


def shown(path: Any) -> str:
    """A path as written, quoted, cut when long."""
    text = str(path)
    return repr(text if len(text) <= PREVIEW * 4 else f"{text[:PREVIEW * 4]}... ({len(text)} characters)")


@dataclass(frozen=True)
class Media:
    """Where the paths of one split are looked up and the folder reads are kept in."""

    folders: tuple[Path, ...] = ()
    """Folders a relative path is looked up in, in order (none: the working folder)."""
    root: Path | None = None
    """Reads stay inside this folder (resolved); None: anywhere (a hub dataset or a Python object
    without media_root)."""
    allow: str = ""
    """How the user widens `root`, for the refusal ("" when it cannot be widened)."""


def media(folders: tuple[Path, ...], data_root: Path | None, media_root: str = "") -> Media:
    """The Media of a split: `media_root` (when set) or the data folder bounds the reads."""
    root = Path(media_root).expanduser() if media_root else data_root
    return Media(tuple(dict.fromkeys(Path(f) for f in folders)), root.resolve() if root is not None else None,
                 "set task.params.media_root=FOLDER to allow reading there")


def media_file(value: str, where: Media, what: str) -> Path:
    """The file `value` (a path from a data row) names, resolved; VlmrlError in one line for a name
    no file can have, a file outside `where.root`, or no file there."""
    try:
        path = Path(value).expanduser()
        if not path.is_absolute():
            candidates = [folder / path for folder in where.folders] or [path]
            path = next((c for c in candidates if c.exists()), candidates[0])
        real = path.resolve()
        inside = where.root is None or real.is_relative_to(where.root)
        found = inside and real.is_file()
    except (OSError, ValueError, RuntimeError) as error:  # too long, a NUL byte, a symlink loop
        raise VlmrlError(f"{what} path {shown(value)} is no file name this system can open "
                         f"({type(error).__name__})") from None
    if not inside:  # said before whether it exists: nothing is learnt of files outside
        raise OutsideFile(f"{what} file {shown(value)} is outside the data folder {where.root}: paths in a data "
                          f"file are read from its folder; {where.allow}")
    if not found:
        looked = f" (looked in {', '.join(map(str, where.folders))})" if where.folders and \
            not Path(value).is_absolute() else ""
        raise VlmrlError(f"{what} file {shown(value)} does not exist{looked}")
    return real
