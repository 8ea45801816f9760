"""Visual tools the model calls during a rollout ("thinking with images"), and the trajectory record.

The call format is Qwen's native one, which its tokenizer keeps whole (`<tool_call>` and
`</tool_call>` are single special tokens in Qwen2/2.5(-VL)):

    <tool_call>
    {"name": "zoom", "arguments": {"box": [x1, y1, x2, y2]}}
    </tool_call>

Generation stops after `</tool_call>`; the rollout parses the call (`parse_tool_call`), runs the
tool (`run_tool`) and appends its result (text and/or images) as the next turn, then generation
goes on, up to `rollout.max_turns` turns and a token budget per trajectory.

Built in: `zoom` (alias `crop`): the region `box` of an example image, in the pixels of the
ORIGINAL image (`Example.originals`, the full-resolution images tools read), resized for the
processor. Your own tools: any Python callable named by import path (`module:function`), called as
`function(context, **arguments)` and returning text, a PIL image, or a list of those.

Nothing a tool does can crash the run: a malformed call, an unknown tool, bad arguments, a tool
that raises, one that runs past its timeout, or a returned image larger than the limit becomes a
`ToolResult` with `error` set and an error message as its text, which the model reads as the tool's
answer; the rollout counts them. No torch here: tasks import this module for the trajectory record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]
    text: str = ""
    """The call as the model wrote it, between the tags (for logs and rewards)."""


@dataclass
class ToolResult:
    """What a tool gave back: text and/or images; `error` set (and explained in `text`) on failure."""

    text: str = ""
    images: list[Image.Image] = field(default_factory=list)
    error: str | None = None
    """None on success, else a short kind: "malformed", "unknown_tool", "bad_arguments", "raised",
    "timeout", "too_large"."""


@dataclass
class ToolContext:
    """What a tool can read: the example's images at full resolution, and the limits it must keep."""

    images: list[Image.Image]
    """Full-resolution images of the example (`Example.originals`), in order."""
    max_side: int = 448
    """Longest side, in pixels, of an image a built-in tool returns (crops are resized to fit)."""


@dataclass
class Turn:
    """One turn of a trajectory after the prompt: the model's text, or a tool's result."""

    role: str  # "assistant" or "tool"
    text: str
    images: list[Image.Image] = field(default_factory=list)
    call: ToolCall | None = None  # assistant turns that end in a call: the parsed call
    error: str | None = None  # tool turns: ToolResult.error


@dataclass
class Trajectory:
    """Everything after the prompt: the model's turns and the tools' results, in order."""

    turns: list[Turn] = field(default_factory=list)
    cut: bool = False
    """True when the turn limit or the token budget ended it before a final answer."""

    @property
    def final_text(self) -> str:
        """The model's last turn (where the final answer is)."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    @property
    def calls(self) -> list[ToolCall]:
        """Every parsed call, in order."""
        return [t.call for t in self.turns if t.call is not None]

    @property
    def errors(self) -> list[str]:
        """The error kind of every failed call, in order."""
        return [t.error for t in self.turns if t.role == "tool" and t.error is not None]
