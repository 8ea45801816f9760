"""A folder that refuses new files, for the tests of the checks that write a probe first (vlmrl check's
output folder, the checkpoint folders): as a read-only folder does to a user who is not root (as root,
chmod refuses nothing, so the tests patch the write instead)."""

from __future__ import annotations

import errno
from pathlib import Path


def read_only_probe(monkeypatch, folder: Path) -> None:
    """`folder` refuses new files written with Path.write_bytes (how the probes are written)."""
    real = Path.write_bytes

    def write_bytes(path, data):
        if path.parent == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
