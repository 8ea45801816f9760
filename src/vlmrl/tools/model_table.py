"""The model tools by name: `MODEL_TOOLS`, the one table a new model tool is added to (its class, a ModelTool
subclass in a module of its own; its model code in vlmrl/models/, named in tool_models.RUNNERS). The
registry (registry.py) reads it; `MODEL_KINDS` (each tool's checkpoint kinds) is kept for old imports."""

from __future__ import annotations

from vlmrl.tools.depth_tool import DepthTool
from vlmrl.tools.detect_tool import DetectTool
from vlmrl.tools.keypoints_tool import KeypointsTool
from vlmrl.tools.model_tools import ModelTool
from vlmrl.tools.segment_tool import SegmentTool

MODEL_TOOLS: dict[str, type[ModelTool]] = {
    "detect": DetectTool,
    "segment": SegmentTool,
    "depth": DepthTool,
    "keypoints": KeypointsTool,
}
"""Each model tool's name and its class."""
MODEL_KINDS: dict[str, tuple[str, ...]] = {name: tool.model_types for name, tool in MODEL_TOOLS.items()}
"""Each model tool's name, and the `model_type`s (config.json) of the checkpoints it runs."""
