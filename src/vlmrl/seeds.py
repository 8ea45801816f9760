"""Stable seeds derived from any values, the same in every process and every run.

Sampling is seeded per generate call from (seed, step, first prompt index), dropout per step, the
evaluation's samples from (seed, "eval", batch): a run resumed from a checkpoint, or spread over
more processes, draws exactly what an uninterrupted single-process run draws. Python's `hash()`
changes between runs, so the seed comes from SHA-256.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from any values (their `str`, joined)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()
    return int(digest[:15], 16)
