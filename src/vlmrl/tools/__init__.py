"""The tools stage: visual tools the model calls during a rollout ("thinking with images").

- contract.py: what a tool is given (`ToolContext`), gives back (`ToolResult`) and must keep (`ToolLimits`);
- calls.py: the call format (`<tool_call>` JSON `</tool_call>`), parsed, and a result shown back;
- trajectory.py: the record of a tool-using rollout (`Trajectory`, its `Turn`s), which tasks score;
- image_tools.py, video_tools.py: the built-in tools `zoom` (alias `crop`), `zoom_window`, `frames`;
- cv_tools.py: the built-in OpenCV tools `find_objects` (regions by colour and shape, set-of-marks) and `measure`;
- model_tools.py: pre-trained models as tools (`rollout.tool_models`): the generic base (`ModelTool`: folder checks,
  answer cache, per-turn batching); one module per tool (detect_tool.py: `detect`, OWLv2, OWL-ViT, Grounding DINO;
  segment_tool.py: `segment`, SAM, SAM-HQ; depth_tool.py: `depth`, Depth Anything, DPT; keypoints_tool.py:
  `keypoints`, ViTPose, SuperPoint);
  model_table.py lists them (`MODEL_TOOLS`); their model code is in vlmrl/models/, imported at the first call;
- cache.py: a tool's answers kept for repeated calls (`AnswerCache`: find_objects, measure, every model tool),
  counted, keyed by `image_key` (a digest of the image's pixels);
- builtin.py: the table of built-in tools by name;
- registry.py: `rollout.tools` resolved into the tools a run may call, your own imported by path;
- results.py: what a tool returns, normalised and checked against the limits;
- running.py: one call run (`run_tool`), in this process or in the tool worker (worker.py).

A tool is `function(context, **arguments)` returning text, a PIL image, a `vlmrl.tasks.Video`, or a list
of those. No torch here: tasks import the trajectory record. `vlmrl.tasks.tools` and
`vlmrl.tasks.tool_worker`, their former home, still name the same objects.
"""

from vlmrl.tools.builtin import BUILTIN_TOOLS
from vlmrl.tools.calls import ToolCall, parse_tool_call
from vlmrl.tools.contract import ToolContext, ToolLimits, ToolResult
from vlmrl.tools.image_tools import zoom, zoom_window
from vlmrl.tools.registry import resolve_tools
from vlmrl.tools.running import call_tool, run_tool
from vlmrl.tools.trajectory import Trajectory, Turn
from vlmrl.tools.video_tools import frames

__all__ = ["BUILTIN_TOOLS", "ToolCall", "ToolContext", "ToolLimits", "ToolResult", "Trajectory", "Turn", "call_tool",
           "frames", "parse_tool_call", "resolve_tools", "run_tool", "zoom", "zoom_window"]
