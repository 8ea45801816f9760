"""A fast path that fails on its first use falls back to the plain path for the rest of the run.

The compiled or static decode (decoding.py), the shared-prefill generation (prefill.py) and the
packed log-prob pass (logprobs.py) are exact when they run, but they meet torch.compile, CUDA-graph
capture and family code that the plain path never touches. `first_use` runs a fast path; an error
on its FIRST use for a model (a compile, graph-capture or family error) switches that model to the
plain path for good, with a one-line warning, and `fallbacks` names what switched (the trainer logs
`fallback/<path>` = 1 from that step on). Once a fast path has run, a later error is a real error
and propagates: a fallback must not hide a bug. Out-of-memory errors and vlmrl's own errors always
propagate (the plain path would need more memory; a VlmrlError is the user's to fix). The random
number generators are put back before the plain path runs, so its samples are those of a run with
the fast path off.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from vlmrl.errors import VlmrlError
from vlmrl.models.support import hf_model, warn_once

T = TypeVar("T")
_STATE = "_vlmrl_fast_paths"
"""The attribute on the Hugging Face model holding {path: "ran" | "fell back"}."""
FAST_PATHS = ("compiled_decode", "static_decode", "shared_prefill", "packed_logprobs")
"""Every fast path that can fall back (the names in `fallback/<path>`)."""
ALWAYS_RAISED = (torch.OutOfMemoryError, VlmrlError)
"""Errors that never make a fast path fall back."""


def _state(model: torch.nn.Module) -> dict[str, str]:
    inner = hf_model(model)
    if _STATE not in inner.__dict__:
        inner.__dict__[_STATE] = {}
    return inner.__dict__[_STATE]


def fallbacks(model: torch.nn.Module) -> list[str]:
    """The fast paths that failed on their first use with `model` (it takes their plain paths)."""
    return sorted(path for path, state in _state(model).items() if state == "fell back")


def fell_back(model: torch.nn.Module, path: str) -> bool:
    """Whether fast path `path` failed on its first use with `model`."""
    return _state(model).get(path) == "fell back"


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore_rng(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def first_use(model: torch.nn.Module, path: str, fast: Callable[[], T], plain: Callable[[], T]) -> T:
    """`fast()`, unless fast path `path` already failed with `model` (then `plain()`). An error of
    its first use with `model` (not out-of-memory, not a VlmrlError) warns once, marks the fallback
    and returns `plain()`, from the random state `fast` started from; later errors propagate."""
    state = _state(model)
    if state.get(path) == "fell back":
        return plain()
    if state.get(path) == "ran":
        return fast()
    rng = _rng_states()
    try:
        result = fast()
    except ALWAYS_RAISED:
        raise
    except Exception as error:
        state[path] = "fell back"
        text = str(error).strip()
        reason = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
        warn_once(f"vlmrl: {path} failed on its first use ({reason}); this run takes the plain path "
                  f"(fallback/{path} in metrics.jsonl)")
        _restore_rng(rng)
        return plain()
    state[path] = "ran"
    return result
