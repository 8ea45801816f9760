"""Toy tools for tests/test_tools.py, loaded by import path (`tool_helpers:echo_tool`) with this
folder on sys.path: one of each way a tool can answer or fail."""

from __future__ import annotations

import threading

from PIL import Image

from vlmrl.tasks.tools import ToolContext

CALLS: list[str] = []
"""The arguments `counted_tool` was called with (to show a call with bad arguments never runs)."""
RELEASE = threading.Event()
"""Set by a test to let a waiting `slow_tool` return early."""
NOT_A_TOOL = 3


def echo_tool(context, text: str) -> str:
    """The text it was given."""
    return text


def size_tool(context) -> str:
    """The size of the example's first image, as WIDTHxHEIGHT (reads the context)."""
    width, height = context.images[0].size
    return f"{width}x{height}"


def counted_tool(context, word: str) -> str:
    """Records `word` in CALLS, then returns it."""
    CALLS.append(word)
    return word


def picky_tool(context, level: int) -> str:
    """ValueError for a negative level (a tool that checks its own arguments)."""
    if level < 0:
        raise ValueError(f"level must be >= 0; got {level}")
    return f"level {level}"


def failing_tool(context, message: str = "out of paint") -> str:
    """Always raises RuntimeError(message)."""
    raise RuntimeError(message)


def slow_tool(context, seconds: float = 5.0) -> str:
    """Waits up to `seconds` (less once RELEASE is set), then returns "done"."""
    RELEASE.wait(seconds)
    return "done"


def huge_tool(context, width: int, height: int) -> Image.Image:
    """A black image of the size asked for."""
    return Image.new("RGB", (width, height))


def long_text_tool(context, n: int) -> str:
    """n letters 'a'."""
    return "a" * n


def mixed_tool(context) -> list:
    """Text, a 2x1 red image, text."""
    return ["left", Image.new("RGB", (2, 1), (255, 0, 0)), "right"]


def number_tool(context) -> int:
    """An int: not something a tool may return."""
    return 42


def zoom(context, box) -> str:
    """Shares its name with the built-in zoom (to test a clash)."""
    return "mine"


def no_context() -> str:
    """Takes no context: not a tool."""
    return "nothing"


def argument_first(box: list) -> str:
    """Its one parameter is an argument the model gives: the context would land in it."""
    return f"{box}"


def annotated_context(view: ToolContext, box: list) -> str:
    """The context under another name, told by its annotation: a tool."""
    return f"{box}"
