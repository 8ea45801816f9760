"""The order rows are served in and the rows held out, as pure functions of the seed.

The data cursor (the index of the next train example) is the only data state a run keeps: example
`idx` of a split of n rows is row `permutation(n, key, epoch)[idx % n]` of epoch `idx // n`, so a
resumed run, or one spread over any number of processes, draws exactly the rows an uninterrupted
one draws. Each epoch has its own permutation, every row once per epoch. A permutation sorts the
rows by a stable hash (BLAKE2b) of (key, epoch, row): the same in every process, platform and Python
version, unlike `random.shuffle` or `hash()`. No torch here.
"""

from __future__ import annotations

import functools
import hashlib


def stable_unit(key: str) -> float:
    """A number in [0, 1) from a stable hash of `key` (BLAKE2b; the same in every process)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


@functools.lru_cache(maxsize=8)
def permutation(n: int, key: str, epoch: int = 0) -> tuple[int, ...]:
    """The rows 0..n-1 in the order of epoch `epoch` under `key` (a seed and a split name, say)."""
    return tuple(sorted(range(n), key=lambda row: stable_unit(f"order:{key}:{epoch}:{row}")))


def draw_row(idx: int, n: int, key: str, per_epoch: bool = True) -> int:
    """The row (of n) served as example `idx`: epoch idx // n, position idx % n of that epoch's
    permutation; `per_epoch=False` reuses epoch 0's permutation for every pass (a held-out set)."""
    epoch, position = divmod(idx, n)
    return permutation(n, key, epoch if per_epoch else 0)[position]


def held_out(n: int, fraction: float, key: str) -> set[int]:
    """The rows (of n) held out as a test split: round(fraction * n) of them (at least 1 when
    fraction > 0, at most n - 1), chosen by `key`'s permutation; by row, never by content, so rows
    that share a question or an answer are split like any others."""
    if fraction <= 0 or n < 2:
        return set()
    count = min(n - 1, max(1, round(fraction * n)))
    return set(permutation(n, f"held-out:{key}")[:count])
