"""The call format: how the model writes a call, how it is parsed, and how a result is shown back.

The format is Qwen's native one, which its tokenizer keeps whole (`<tool_call>` and `</tool_call>` are
single tokens in Qwen2/2.5(-VL)):

    <tool_call>
    {"name": "zoom", "arguments": {"box": [x1, y1, x2, y2]}}
    </tool_call>

Generation stops after `</tool_call>` (`ends_with_call` tells the rollout a turn ended in a call);
the rollout parses the call (`parse_tool_call`), runs the tool (running.py) and appends its result
(`tool_result_text` and the images) as the next turn, then generation goes on, up to
`rollout.max_turns` turns and a token budget per trajectory. Since generation stops at the first
`</tool_call>`, a turn holds at most one call; given more, `parse_tool_call` reads the last complete
one, and text after the last `</tool_call>` is ignored. A tool's text is shown with the call
format's tags and the model family's own image and control tokens (read from its processor by the
rollout) defused, so it can neither end its turn nor add an image placeholder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

from vlmrl.tools.contract import ToolResult, one_line, valid_text


TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]
    text: str = ""
    """The call as the model wrote it, between the tags (for logs and rewards)."""


def ends_with_call(text: str) -> bool:
    """True when the turn's last non-space content is `</tool_call>`: the rollout runs a tool, else it stops."""
    return text.rstrip().endswith(TOOL_CALL_CLOSE)


def _malformed(message: str) -> ToolResult:
    """A "malformed" result whose text is `error: <message>`, one line."""
    return ToolResult(text=one_line(f"error: {message}"), error="malformed")


def parse_tool_call(text: str) -> ToolCall | ToolResult:
    """The last complete call in `text` (`<tool_call>` JSON `</tool_call>`; text after it is ignored), or a
    "malformed" ToolResult saying what is wrong. The JSON is `{"name": str, "arguments": {...}}`."""
    end = text.rfind(TOOL_CALL_CLOSE)
    if end < 0:
        return _malformed(f"no call: a call is {TOOL_CALL_OPEN}"
                          f'{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}')
    start = text.rfind(TOOL_CALL_OPEN, 0, end)
    if start < 0:
        return _malformed(f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN} before it")
    inner = text[start + len(TOOL_CALL_OPEN):end].strip()
    try:
        data = json.loads(inner)
    except json.JSONDecodeError as error:
        return _malformed(f"the call is not valid JSON: {error}")
    if not (isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"]
            and isinstance(data.get("arguments"), dict)):
        return _malformed('a call needs "name" (a string) and "arguments" (an object), '
                          'as in {"name": "zoom", "arguments": {"box": [0, 0, 100, 100]}}')
    return ToolCall(name=data["name"], arguments=data["arguments"], text=inner)


def neutralise(text: str, markers: Iterable[str]) -> str:
    """`text` with every occurrence of a marker (a model family's image or control token, as its processor
    names them) broken by a space after its first character: no tokenizer reads it as the token and no
    processor counts it as an image placeholder. Markers shorter than 2 characters or blank are left."""
    words = sorted({m for m in markers if isinstance(m, str) and len(m) > 1 and m.strip()}, key=len, reverse=True)
    if not words:
        return text
    pattern = re.compile("|".join(re.escape(word) for word in words))
    for _ in range(4):  # a break could in theory form another marker: break that too
        if not pattern.search(text):
            return text
        text = pattern.sub(lambda match: match[0][0] + " " + match[0][1:], text)
    return pattern.sub("", text)


def tool_result_text(result: ToolResult, markers: Iterable[str] = ()) -> str:
    """The text shown to the model inside `<tool_response>` ... `</tool_response>`: the result's text (an
    error's message; empty for images alone, whose placeholders the rollout adds) as valid UTF-8, with
    the markers that could close the response or open a turn (`<tool_response>`, `<tool_call>`, `<|...|>`)
    and the family's own `markers` (its image and control tokens) defused."""
    text = re.sub(r"<(/?tool_(?:call|response))>", r"[\1]", valid_text(result.text))
    return neutralise(text.replace("<|", "< |").replace("|>", "| >"), markers)
