"""The tool contract: what a tool is given (`ToolContext`), what a call gives back (`ToolResult`), the limits
it keeps (`ToolLimits`), and how a failure reads (`error_result`: one line starting "error: ").

A tool is `function(context, **arguments)` returning text, a PIL image, a `vlmrl.tasks.Video`, or a list
of those (results.py normalises what it returns). Nothing a tool does can crash the run: a malformed
call, an unknown tool, bad arguments, a tool that raises, one that runs past its timeout or kills its
worker, or a returned image larger than the limit becomes a `ToolResult` with `error` set (one of
`ERROR_KINDS`) and a one-line message starting "error: " as its text, which the model reads as the
tool's answer; the rollout counts them. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from vlmrl.data.video import Video
from vlmrl.errors import VlmrlError


ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "too_large")
"""Every value `ToolResult.error` takes on failure."""
MESSAGE_CHARS = 300
"""Longest error message (the exception text inside it is cut to fit)."""


@dataclass
class ToolResult:
    """What a tool gave back: text, images and/or videos; `error` set (and explained in `text`) on failure."""

    text: str = ""
    images: list[Image.Image] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)
    error: str | None = None
    """None on success, else a short kind: "malformed", "unknown_tool", "bad_arguments", "raised",
    "timeout", "too_large"."""


@dataclass
class ToolContext:
    """What a tool can read: the example's images at full resolution, and the limits it must keep."""

    images: list[Image.Image]
    """Full-resolution images of the example (`Example.originals`), in order: copies, for your own
    tools (they run in the tool worker); the built-in tools read the originals and never change them."""
    max_side: int = 448
    """Longest side, in pixels, of an image a built-in tool returns (crops are resized to fit)."""
    videos: list = field(default_factory=list)
    """The example's videos at their full frame rate and resolution (`Example.video_originals`, each a
    `vlmrl.tasks.Video`), in order: what `frames` reads."""


MAX_TOOL_TIMEOUT_S = 3600
"""Longest a call of your own tool may run, an hour: past about 10**8 s the worker's wait overflows.
The same bound as config.MAX_TOOL_TIMEOUT_S, which checks rollout.tool_timeout_s where the config is
read (tasks import no config; tests/test_tools.py holds the two equal)."""


@dataclass
class ToolLimits:
    """What `run_tool` allows a tool: its time, the size of the images and text it returns."""

    timeout_s: float = 5.0
    """Seconds a call of your own tool may run; past that it counts as "timeout" and its worker is killed
    and replaced. The built-in tools run in the process, untimed (they are quick and always return)."""
    max_image_pixels: int = 1024 * 1024
    """Largest width * height of a returned image; a larger one makes the call "too_large"."""
    max_text_chars: int = 2000
    """Longest text returned; longer text is cut to this and marked (`TRUNCATED`)."""

    def validate(self) -> None:
        """Raise VlmrlError unless every limit is positive."""
        if not (self.timeout_s > 0 and self.max_image_pixels >= 1 and self.max_text_chars >= 1):
            raise VlmrlError(f"tool limits must be > 0: timeout_s={self.timeout_s}, "
                             f"max_image_pixels={self.max_image_pixels}, max_text_chars={self.max_text_chars}")
        if not self.timeout_s <= MAX_TOOL_TIMEOUT_S:
            raise VlmrlError(f"tool timeout_s must be at most {MAX_TOOL_TIMEOUT_S:,} s; got {self.timeout_s}")


def valid_text(text: str) -> str:
    """`text` as valid UTF-8: a lone surrogate (which no tokenizer or file can take) becomes "?"."""
    return text.encode("utf-8", "replace").decode("utf-8")


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` on one line (whitespace runs become one space), cut to `limit` characters with "..."."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def error_result(kind: str, message: str) -> ToolResult:
    """A failed call: `error` = kind, text = `error: <message>` on one line, valid UTF-8."""
    return ToolResult(text=one_line(valid_text(f"error: {message}")), error=kind)
