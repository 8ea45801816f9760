"""The tools' former home: the call format, the registry, the worker and the built-in tools live in
vlmrl/tools/ now (one module per job: see its package docstring). This module stays so that code,
docs and pickles that name `vlmrl.tasks.tools.X` still find the same objects; new code imports from
`vlmrl.tools` (or its modules)."""

from vlmrl.data.video import Video
from vlmrl.tools.builtin import BUILTIN_TOOLS
from vlmrl.tools.calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    _malformed,
    ends_with_call,
    neutralise,
    parse_tool_call,
    tool_result_text,
)
from vlmrl.tools.contract import (
    ERROR_KINDS,
    MAX_TOOL_TIMEOUT_S,
    MESSAGE_CHARS,
    ToolContext,
    ToolLimits,
    ToolResult,
    error_result,
    one_line,
    valid_text,
)
from vlmrl.tools.image_tools import WINDOW_GRID, _number, _pixel_box, fit_side, window_box, zoom, zoom_window
from vlmrl.tools.registry import (
    IMPORT_S,
    SLOW_IMPORT_S,
    _check_takes_context,
    _import_tool,
    _unknown_tool,
    import_only,
    resolve_tools,
)
from vlmrl.tools.results import (
    MAX_ASPECT,
    MAX_VIDEO_FRAMES,
    MIN_SIDE,
    TRUNCATED,
    _returned,
    _returned_image,
    _returned_video,
    sane_image,
    sane_size,
)
from vlmrl.tools.running import call_tool, run_tool
from vlmrl.tools.trajectory import Trajectory, Turn
from vlmrl.tools.video_tools import FRAMES_PER_CALL, _seconds, frames
from vlmrl.tools.worker import WORKER, WorkerFailed, WorkerTimeout

_one_line, _failed = one_line, error_result  # their names here before the move

__all__ = ["BUILTIN_TOOLS", "ERROR_KINDS", "FRAMES_PER_CALL", "IMPORT_S", "MAX_ASPECT", "MAX_TOOL_TIMEOUT_S",
           "MAX_VIDEO_FRAMES", "MESSAGE_CHARS", "MIN_SIDE", "SLOW_IMPORT_S", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN",
           "TRUNCATED", "WINDOW_GRID", "WORKER", "ToolCall", "ToolContext", "ToolLimits", "ToolResult", "Trajectory",
           "Turn", "Video", "WorkerFailed", "WorkerTimeout", "call_tool", "ends_with_call", "fit_side", "frames",
           "import_only", "neutralise", "parse_tool_call", "resolve_tools", "run_tool", "sane_image", "sane_size",
           "tool_result_text", "valid_text", "window_box", "zoom", "zoom_window"]
