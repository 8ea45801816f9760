"""A tool's answers kept for repeated calls: a bounded LRU keyed by the image's content and the arguments, counted.

The G completions of a group often make the same call on the same image (`find_objects(colour="blue")`), so a
deterministic tool computes it once per step: `AnswerCache.answer(key, compute)` runs `compute()` only for a key
it does not hold, keeps the answer (the last `size` keys, least recently used out first) and hands every caller
its own copy of the images (a caller may draw on what it gets; the kept answer stays as it was computed). It is
invisible otherwise: a tool with the cache returns what it returns without it (tests/test_tool_cache.py).

The key is the caller's: `image_key(image)` (mode, size and a digest of the pixels: the same picture in another
object hits, an edited one misses) with `argument_key(...)` of the arguments as the model wrote them (tagged by
type, so that 1, 1.0 and True, equal in Python, are three keys: a tool may accept one and refuse another) and
whatever else the answer depends on (the image's number, the overlay's side). An error is never kept: a call
that raises raises again.

`calls` counts the calls, `computed` the answers computed (by `answer`, or by the owner and handed to `store`,
as a batched prefetch does); `calls - computed` were answered from the cache. The tool rollout reads the two
counters of every cached tool's `answer_cache` (`counts_of`: find_objects', measure's, every ModelTool's), and
logs `tools/<name>/calls` and `tools/<name>/cache_hit_rate` per step. No torch here.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Any, Callable

from PIL import Image

CV_CACHE_SIZE = 48
"""Answers find_objects and measure each keep (the distinct calls of a step, about: 8 prompts' images, a few calls
each). Each find_objects answer holds its set-of-marks image, at most `rollout.tool_image_side` a side: 37 kB at
112 px, 0.6 MB at 448 px."""


def image_key(image: Image.Image) -> tuple:
    """What identifies an image's content: its mode, size and a digest of its pixels (a millisecond at 448 px)."""
    return image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).hexdigest()


def argument_key(value: Any) -> tuple | None:
    """A hashable stand-in for a call's argument `value` (JSON-like: None, bool, int, float, str, lists and dicts of
    them), each leaf tagged with its type (1, 1.0 and True are three keys); None for anything else or a NaN (not
    cached: NaN equals nothing)."""
    if value is None or isinstance(value, (bool, int, str)):
        return type(value).__name__, value
    if isinstance(value, float):
        return None if math.isnan(value) else ("float", value)
    if isinstance(value, (list, tuple)):
        parts = [argument_key(v) for v in value]
        return None if any(p is None for p in parts) else (type(value).__name__, tuple(parts))
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        parts = [(k, argument_key(v)) for k, v in sorted(value.items())]
        return None if any(p is None for _, p in parts) else ("dict", tuple(parts))
    return None


def _fresh(answer: Any) -> Any:
    """The caller's own copy of `answer`: text as it is, each image of a list copied."""
    if isinstance(answer, Image.Image):
        return answer.copy()
    if isinstance(answer, (list, tuple)):
        return [part.copy() if isinstance(part, Image.Image) else part for part in answer]
    return answer


class AnswerCache:
    """The last `size` answers of one tool by key (module docstring); `size` 0 keeps nothing (every call computes)."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[tuple, Any] = OrderedDict()
        self.calls = self.computed = 0

    def __repr__(self) -> str:
        return f"AnswerCache(size={self.size}, held={len(self.entries)}, calls={self.calls}, computed={self.computed})"

    @property
    def cache_hits(self) -> int:
        """Calls answered without computing anything of their own."""
        return self.calls - self.computed

    def __contains__(self, key: tuple | None) -> bool:
        return key is not None and key in self.entries

    def store(self, key: tuple | None, answer: Any) -> None:
        """Keep `answer`, computed by the owner (a batched prefetch), under `key`, counted as computed; the least
        recently used answer goes out past `size`. A None key keeps nothing."""
        self.computed += 1
        self._keep(key, answer)

    def _keep(self, key: tuple | None, answer: Any) -> None:
        if key is None or self.size <= 0:
            return
        self.entries[key] = answer
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def answer(self, key: tuple | None, compute: Callable[[], Any]) -> Any:
        """The answer kept under `key`, else `compute()`'s, kept; either way the caller's own copy of its images.
        A None key (arguments `argument_key` does not take) computes and keeps nothing. An exception from
        `compute` is raised as it is and nothing is kept (the call counts as computed: it ran, and its next
        repeat runs again)."""
        self.calls += 1
        if key in self:
            self.entries.move_to_end(key)
            return _fresh(self.entries[key])
        self.computed += 1
        value = compute()
        self._keep(key, value)
        return _fresh(value)

    def clear(self) -> None:
        """Forget every answer (the counters stay)."""
        self.entries.clear()


def counts_of(tool: Any) -> tuple[int, int] | None:
    """(calls, computed) so far of a cached tool, read from its `answer_cache` (find_objects, measure, every
    ModelTool); None for a tool that keeps no cache."""
    cache = getattr(tool, "answer_cache", None)
    return (cache.calls, cache.computed) if isinstance(cache, AnswerCache) else None
